"""Property tests: the solver equals brute force over every cut on small random instances."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.solver import Infeasible, StageCosts, solve

SETTINGS = settings(max_examples=200, deadline=None)


def _brute(compute, cut, static, act, tied, stages, inflight, limit):
    """Lexicographic min of (bottleneck, peak memory) over all cuts, by plain Python sums."""
    n = len(compute)
    best = None
    for inner in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *inner, n)
        times, mems = [], []
        for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
            t = sum(compute[a:b]) + (cut[a - 1] if a > 0 else 0) + (cut[b - 1] if b < n else 0)
            m = sum(static[a:b]) + inflight[s] * sum(act[a:b])
            for w, users in tied:
                m -= w * max(sum(1 for u in users if a <= u < b) - 1, 0)
            times.append(t)
            mems.append(m)
        if limit is not None and max(mems) > limit:
            continue
        key = (max(times), max(mems))
        if best is None or key < best:
            best = key
    return best


@st.composite
def instances(draw, memory: bool, comm: bool):
    n = draw(st.integers(1, 8))
    stages = draw(st.integers(1, n))
    small = st.integers(0, 9)
    compute = [float(draw(small)) for _ in range(n)]
    cut = [float(draw(small)) if comm else 0.0 for _ in range(n - 1)]
    static = [draw(small) for _ in range(n)] if memory else [0] * n
    act = [draw(st.integers(0, 5)) for _ in range(n)] if memory else [0] * n
    inflight = [draw(st.integers(1, 4)) for _ in range(stages)]
    tied = []
    if memory and n >= 2 and draw(st.booleans()):
        users = sorted(draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=n)))
        w = min(static[u] for u in users)  # a layer's figures include the tied tensor it uses
        tied = [(w, users)]
    limit = draw(st.one_of(st.none(), st.integers(0, 80))) if memory else None
    return compute, cut, static, act, tied, stages, inflight, limit


def _check(inst) -> None:
    compute, cut, static, act, tied, stages, inflight, limit = inst
    expected = _brute(compute, cut, static, act, tied, stages, inflight, limit)
    costs = StageCosts(compute, cut, static, act, tied)
    try:
        got = solve(costs, stages, inflight=inflight, limit=limit)
    except Infeasible:
        assert expected is None
        return
    assert expected is not None
    b = got.boundaries
    assert b[0] == 0 and b[-1] == len(compute) and len(b) == stages + 1
    assert all(x < y for x, y in zip(b, b[1:])), "an empty stage"
    assert (got.bottleneck, got.peak_memory) == expected
    # The reported figures are those of the returned cut.
    assert got.bottleneck == max(costs.cost(x, y) for x, y in zip(b, b[1:]))
    assert got.peak_memory == max(costs.memory(x, y, inflight[s]) for s, (x, y) in enumerate(zip(b, b[1:])))


@SETTINGS
@given(instances(memory=False, comm=False))
def test_equals_brute_force_compute_only(inst) -> None:
    """With compute only, the bottleneck equals the best over every cut."""
    _check(inst)


@SETTINGS
@given(instances(memory=False, comm=True))
def test_equals_brute_force_with_communication(inst) -> None:
    """With cut costs (non-monotone stage cost) the bottleneck still equals brute force."""
    _check(inst)


@SETTINGS
@given(instances(memory=True, comm=True))
def test_equals_brute_force_with_memory(inst) -> None:
    """Under memory limits, in-flight counts and tied tensors: same (bottleneck, peak) as brute force, same feasibility."""
    _check(inst)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.001, 1000.0, allow_nan=False), min_size=2, max_size=40), st.data())
def test_real_valued_times_never_beaten_by_brute_force(compute, data) -> None:
    """With arbitrary float times the solver is never worse than brute force (within rounding)."""
    stages = data.draw(st.integers(1, min(len(compute), 4)))
    n = len(compute)
    got = solve(compute, stages)
    if n <= 14:
        best = min(
            max(sum(compute[a:b]) for a, b in zip((0, *c), (*c, n)))
            for c in itertools.combinations(range(1, n), stages - 1)
        )
        assert abs(got.bottleneck - best) <= 1e-9 * max(best, 1.0)
    assert all(x < y for x, y in zip(got.boundaries, got.boundaries[1:]))
