"""Restricted cuts: the step solver over only the cuts an engine allows equals brute force over those cuts.

``ChunkCosts.restrict`` merges the layers between allowed cuts into groups; every chunk whose ends
are allowed cuts must cost the same in both (time, communication, memory with tied tensors, one-layer
peaks and receive buffers), and the solver over the groups must find the least simulated step of
every allowed cut and recompute mode, as brute force does by hand.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _event_sim import simulate_events
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.planner.chunk_costs import ChunkCosts
from autopipe.planner.schedules import inflight_counts
from autopipe.planner.step_solver import NoCutFits, solve_step


@st.composite
def restricted_problems(draw):
    """Random per-layer costs (tied tensor, recompute mode, receive buffers), a schedule, and a set of allowed cuts."""
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved1f1b", "zbv"]))
    v = 2 if schedule in ("interleaved1f1b", "zbv") else 1
    n = draw(st.integers(2 * v, 9))
    f = [float(draw(st.integers(0, 6))) for _ in range(n)]
    b = [float(draw(st.integers(0, 9))) for _ in range(n)]
    ow = [draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in range(n - 1)]
    static = [draw(st.integers(0, 9)) for _ in range(n)]
    act = [draw(st.integers(0, 5)) for _ in range(n)]
    kept = [draw(st.integers(0, 2)) for _ in range(n)]
    tied = ()
    if draw(st.booleans()):
        users = sorted(draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=n)))
        tied = ((min(static[u] for u in users), users),)
    cut_bytes = [draw(st.integers(0, 3))] * (n - 1)  # one size at every cut: a transformer's hidden states
    m_buf = draw(st.integers(0, 2))
    costs = ChunkCosts(f, b, ow, static, act, tied, {"full": (f, kept)}, held=draw(st.integers(0, 3)),
                       buffers=m_buf, cut_bytes=cut_bytes)  # fmt: skip
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=v - 1, max_size=n - 1)))
    stages = draw(st.integers(1, (len(cuts) + 1) // v))
    m = stages * draw(st.integers(1, 2)) if schedule == "interleaved1f1b" else draw(st.integers(1, 5))
    limit = draw(st.one_of(st.none(), st.integers(5, 80)))
    modes = draw(st.sampled_from([(0,), (0, 1)]))
    return costs, schedule, stages, v, m, limit, modes, cuts


def _brute(costs, schedule, stages, v, m, limit, modes, cuts) -> float | None:
    """Least simulated step over every cut made of allowed cuts and every mode per chunk that fits."""
    k = stages * v
    infl = inflight_counts(schedule, stages, v, m)
    best = None
    for inner in itertools.combinations(cuts, k - 1):
        bd = (0, *inner, costs.n)
        pairs = list(zip(bd, bd[1:]))
        if schedule == "zbv":  # its order depends on the costs: each chunk in its fastest mode that fits, as planned
            choices = [tuple(next((md for md in sorted(modes, key=lambda md: float(costs.extra_of(a, b, md)))
                                   if limit is None or costs.memory(a, b, infl[c], md) <= limit), -1)
                             for c, (a, b) in enumerate(pairs))]  # fmt: skip
        else:
            choices = itertools.product(modes, repeat=k)
        for chosen in choices:
            if -1 in chosen or (limit is not None and any(
                    costs.memory(a, b, infl[c], md) > limit for c, ((a, b), md) in enumerate(zip(pairs, chosen)))):  # fmt: skip
                continue
            step = simulate_events(schedule, forward=[float(costs.forward(a, b)) for a, b in pairs],
                                   backward=[float(costs.backward(a, b, md)) for (a, b), md in zip(pairs, chosen)],
                                   comm=[float(costs.comm(a, b)) for a, b in pairs], ranks=stages,
                                   microbatches=m).step_time  # fmt: skip
            best = step if best is None else min(best, step)
    return best


@settings(max_examples=150, deadline=None)
@given(restricted_problems())
def test_restricted_chunks_cost_what_the_full_ones_cost(problem) -> None:
    """Every chunk between allowed cuts: same seconds, send/recv and bytes (each mode, in flight, waiting) in both."""
    costs, _schedule, _stages, _v, _m, _limit, _modes, cuts = problem
    coarse = costs.restrict(cuts)
    p = coarse.positions
    assert p.tolist() == [0, *cuts, costs.n] and coarse.n == len(cuts) + 1
    for i, j in itertools.combinations(range(coarse.n + 1), 2):
        a, b = int(p[i]), int(p[j])
        assert float(coarse.time(i, j)) == float(costs.time(a, b))
        assert float(coarse.comm(i, j)) == float(costs.comm(a, b))
        for md in (0, 1):
            assert float(coarse.backward(i, j, md)) == float(costs.backward(a, b, md))
            for inflight, waiting in ((1, 0), (3, 0), (3, 2)):
                assert int(coarse.memory(i, j, inflight, md, waiting)) == int(costs.memory(a, b, inflight, md, waiting))


@settings(max_examples=200, deadline=None)
@given(restricted_problems())
def test_restricted_step_is_the_least_of_every_allowed_cut(problem) -> None:
    """The solver with ``cuts`` returns a cut made of allowed cuts whose step is brute force's least, same feasibility."""
    costs, schedule, stages, v, m, limit, modes, cuts = problem
    expected = _brute(costs, schedule, stages, v, m, limit, modes, cuts)
    try:
        sol = solve_step(costs, schedule, ranks=stages, virtual=v, microbatches=m, limit=limit, modes=modes, cuts=cuts)
    except NoCutFits:
        assert expected is None
        return
    assert expected is not None
    assert set(sol.boundaries[1:-1]) <= set(cuts) and sol.boundaries[0] == 0 and sol.boundaries[-1] == costs.n
    assert sol.step == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert sol.exact and sol.lower_bound <= sol.step * (1 + 1e-9)


@settings(max_examples=150, deadline=None)
@given(restricted_problems())
def test_restricted_bound_holds_without_brute_force(problem) -> None:
    """Bounds and candidates only (no enumeration): the bound never exceeds the best allowed cut."""
    costs, schedule, stages, v, m, limit, modes, cuts = problem
    expected = _brute(costs, schedule, stages, v, m, limit, modes, cuts)
    try:
        sol = solve_step(costs, schedule, ranks=stages, virtual=v, microbatches=m, limit=limit, modes=modes, cuts=cuts,
                         enumerate_work=0)  # fmt: skip
    except NoCutFits:
        assert expected is None
        return
    assert expected is not None
    assert set(sol.boundaries[1:-1]) <= set(cuts)
    assert sol.lower_bound <= expected * (1 + 1e-9) + 1e-12
    assert sol.step >= expected * (1 - 1e-9) - 1e-12


def test_a_restriction_costs_what_it_must() -> None:
    """Uneven layers where the best cut is inside a group: the restricted optimum is the best of the allowed cuts."""
    costs = ChunkCosts(forward=[1, 1, 1, 1, 1, 1], backward=[2, 2, 2, 2, 2, 2])
    free = solve_step(costs, "1f1b", ranks=2, microbatches=4)
    assert free.boundaries == (0, 3, 6)
    held = solve_step(costs, "1f1b", ranks=2, microbatches=4, cuts=[2, 4])
    assert held.boundaries in ((0, 2, 6), (0, 4, 6)) and held.step > free.step
    with pytest.raises(ValueError, match="1 allowed cuts leave at most 2"):
        solve_step(costs, "1f1b", ranks=3, microbatches=4, cuts=[2])
    assert np.array_equal(costs.restrict([]).positions, [0, 6])
