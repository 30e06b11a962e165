"""Schedule simulator: exact step times on hand-checkable pipelines, and a valid timeline always."""

from __future__ import annotations

import pytest
from _torch_orders import torch_zbv_order as _torch_zbv_order
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.errors import PartitionError
from autopipe.planner.schedules import (
    chunk_ranks,
    inflight_counts,
    normalize_schedule,
    simulate,
    step_times,
    zbv_order,
)


def _equal(schedule: str, ranks: int, virtual: int, m: int, f: float, b: float, c: float = 0.0):
    k = ranks * virtual
    return simulate(schedule, forward=[f] * k, backward=[b] * k, comm=[c] * k, ranks=ranks, microbatches=m)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks,m", [(1, 1), (2, 4), (4, 8), (4, 3), (8, 16)])
def test_equal_stages_step_is_m_plus_s_minus_1_times_f_plus_b(schedule: str, ranks: int, m: int) -> None:
    """GPipe and 1F1B with equal stages take (M + S - 1)(f + b)."""
    sim = _equal(schedule, ranks, 1, m, 1.0, 2.0)
    assert sim.step_time == pytest.approx((m + ranks - 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx((ranks - 1) / (m + ranks - 1))


def test_communication_is_charged_to_both_directions() -> None:
    """A chunk's send/recv time lengthens its forward and its backward: (M + S - 1)(f + b + 2c)."""
    sim = _equal("gpipe", 3, 1, 5, 1.0, 2.0, c=0.5)
    assert sim.step_time == pytest.approx((5 + 3 - 1) * 4.0)


@pytest.mark.parametrize("ranks,virtual,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (8, 2, 16)])
def test_interleaved_bubble_shrinks_by_virtual_stages(ranks: int, virtual: int, m: int) -> None:
    """Interleaved 1F1B with equal chunks of 1/v of a stage: M(f + b) + (S - 1)(f + b)/v."""
    f, b = 1.0 / virtual, 2.0 / virtual
    sim = _equal("interleaved1f1b", ranks, virtual, m, f, b)
    assert sim.step_time == pytest.approx(m * 3.0 + (ranks - 1) * 3.0 / virtual)


@pytest.mark.parametrize("ranks,m", [(2, 4), (4, 8), (8, 16)])
def test_zbv_bubble_is_below_1f1b(ranks: int, m: int) -> None:
    """ZBV (V placement, split backward) idles less than 1F1B on the same total work."""
    zb = _equal("zbv", ranks, 2, m, 0.5, 1.0)
    one = _equal("1f1b", ranks, 1, m, 1.0, 2.0)
    assert zb.step_time < one.step_time
    assert zb.bubble_fraction < one.bubble_fraction
    assert zb.step_time >= m * 3.0  # no rank can beat its own work


def test_inflight_counts_follow_the_schedules() -> None:
    """GPipe holds all M micro-batches on every stage; 1F1B holds min(S - s, M) at stage s."""
    assert inflight_counts("gpipe", 4, 1, 6) == [6, 6, 6, 6]
    assert inflight_counts("1f1b", 4, 1, 8) == [4, 3, 2, 1]
    assert inflight_counts("1f1b", 4, 1, 2) == [2, 2, 2, 1]


def test_placement_round_robin_and_v() -> None:
    """Interleaved places chunk c on rank c % S; zbv places chunks in a V."""
    assert chunk_ranks("interleaved1f1b", 3, 2) == (0, 1, 2, 0, 1, 2)
    assert chunk_ranks("zbv", 3, 2) == (0, 1, 2, 2, 1, 0)
    assert chunk_ranks("1f1b", 3, 1) == (0, 1, 2)


def test_bad_schedule_options_are_explained() -> None:
    """Unknown names, wrong virtual stages and M not a multiple of S raise PartitionError with the fix."""
    with pytest.raises(PartitionError, match="unknown schedule"):
        normalize_schedule("pipedream")
    with pytest.raises(PartitionError, match="multiple of the stages"):
        _equal("interleaved1f1b", 4, 2, 6, 1.0, 1.0)
    with pytest.raises(PartitionError, match="virtual"):
        _equal("1f1b", 2, 2, 4, 1.0, 1.0)
    with pytest.raises(PartitionError, match="weight_share must be between 0 and 1"):
        simulate("zbv", forward=[1.0] * 4, backward=[1.0] * 4, comm=[0.0] * 4, ranks=2, microbatches=4, weight_share=2.0)
    assert normalize_schedule("Interleaved1F1B") == "interleaved1f1b"
    assert normalize_schedule("ScheduleZBVZeroBubble") == "zbv"


@st.composite
def _pipelines(draw):
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved1f1b", "zbv"]))
    ranks = draw(st.integers(1, 5))
    virtual = {"gpipe": 1, "1f1b": 1, "zbv": 2}.get(schedule) or draw(st.integers(2, 3))
    m = draw(st.integers(1, 10))
    if schedule == "interleaved1f1b":
        m = ranks * draw(st.integers(1, 3))
    k = ranks * virtual
    dur = st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5])
    fwd = [draw(dur) for _ in range(k)]
    bwd = [draw(dur) for _ in range(k)]
    comm = [draw(st.sampled_from([0.0, 0.25])) for _ in range(k)]
    return schedule, ranks, m, fwd, bwd, comm


@settings(max_examples=150, deadline=None)
@given(_pipelines())
def test_timeline_is_a_valid_execution(case) -> None:
    """Every op runs once, ops on a rank never overlap, and each op starts after what it needs."""
    schedule, ranks, m, fwd, bwd, comm = case
    sim = simulate(schedule, forward=fwd, backward=bwd, comm=comm, ranks=ranks, microbatches=m)
    k = len(fwd)
    place = chunk_ranks(schedule, ranks, k // ranks)
    kinds = "FBW" if schedule == "zbv" else "FB"
    end = {}
    for r, tl in enumerate(sim.timeline):
        for (s0, e0, *_), (s1, *_rest) in zip(tl, tl[1:]):
            assert e0 <= s1 + 1e-12
        for start, stop, kind, mb, c in tl:
            assert place[c] == r
            end[(kind, mb, c)] = (start, stop)
    assert set(end) == {(kd, mb, c) for kd in kinds for mb in range(m) for c in range(k)}
    for (kind, mb, c), (start, _) in end.items():
        needs = {"F": [("F", mb, c - 1)] if c else [], "W": [("B", mb, c)]}.get(kind)
        if needs is None:
            needs = [("F", mb, c)] + ([("B", mb, c + 1)] if c < k - 1 else [])
        for d in needs:
            assert end[d][1] <= start + 1e-12
    assert sim.step_time == pytest.approx(max(e for tl in sim.timeline for _, e, *_ in tl))
    assert 0.0 <= sim.bubble_fraction <= 1.0 + 1e-12


def _held_peak(sim, chunks: int) -> list[int]:
    """Per chunk, the most micro-batches held at once in a timeline: from F to W (zbv) or B."""
    release = "W" if sim.schedule == "zbv" else "B"
    peak = [0] * chunks
    for tl in sim.timeline:
        held = [0] * chunks
        for _, _, kind, _, c in tl:
            if kind == "F":
                held[c] += 1
                peak[c] = max(peak[c], held[c])
            elif kind == release:
                held[c] -= 1
    return peak


@settings(max_examples=150, deadline=None)
@given(_pipelines())
def test_inflight_counts_bound_every_cost(case) -> None:
    """What partition charges per chunk is never less than what any costs make a fixed-order schedule hold."""
    schedule, ranks, m, fwd, bwd, comm = case
    if schedule == "zbv":  # charged as torch orders it (next tests), not as the greedy simulation does
        return
    k = len(fwd)
    sim = simulate(schedule, forward=fwd, backward=bwd, comm=comm, ranks=ranks, microbatches=m)
    charged = inflight_counts(schedule, ranks, k // ranks, m)
    assert all(h <= c for h, c in zip(_held_peak(sim, k), charged)), (_held_peak(sim, k), charged)


def test_zbv_order_is_the_one_torch_runs() -> None:
    """autopipe's ZB-V order equals torch's, op for op, for 1-6 ranks and 1-19 micro-batches."""
    for ranks in range(1, 7):
        for m in range(1, 20):
            for r in range(ranks):
                assert zbv_order(ranks, m, r) == _torch_zbv_order(ranks, m, r), (ranks, m, r)


def test_zbv_is_timed_in_the_order_torch_runs() -> None:
    """simulate("zbv") plays each rank's ops in torch's ZB-V order, whatever the costs, and a W never
    starts before its own B; with equal costs the V leaves almost no bubble."""
    import random

    rng = random.Random(3)
    for ranks, m in ((2, 8), (3, 5), (4, 9)):
        k = 2 * ranks
        fwd = [rng.uniform(0.2, 3.0) for _ in range(k)]
        bwd = [rng.uniform(0.2, 6.0) for _ in range(k)]
        sim = simulate("zbv", forward=fwd, backward=bwd, comm=[0.1] * k, ranks=ranks, microbatches=m)
        for r, tl in enumerate(sim.timeline):
            assert [(kind, mb, c) for _, _, kind, mb, c in tl] == _torch_zbv_order(ranks, m, r)
            ends = {(kind, mb, c): e for _, e, kind, mb, c in tl}
            assert all(s >= ends[("B", mb, c)] for s, _, kind, mb, c in tl if kind == "W")
    even = simulate("zbv", forward=[1.0] * 4, backward=[2.0] * 4, comm=[0.0] * 4, ranks=2, microbatches=8)
    assert even.step_time == 49.0  # 48 s of work per rank, one second of bubble


def test_zbv_inflight_is_read_off_torch_s_order() -> None:
    """zbv holds a unit from F to W: 2S, 2S-1, ... on the shallow chunks, down to 1 on rank 0's deep one
    (the former min(M, 2S) on every chunk charged rank 0 4 + 4 micro-batches at S = 2, M = 8; it holds 4 + 1)."""
    assert inflight_counts("zbv", 2, 2, 8) == [4, 3, 2, 1]
    assert inflight_counts("zbv", 4, 2, 5) == [5, 5, 5, 5, 4, 3, 2, 1]
    assert inflight_counts("zbv", 4, 2, 16) == [8, 7, 6, 5, 4, 3, 2, 1]
    for ranks, m in ((2, 3), (3, 7), (5, 12)):
        held = [0] * (2 * ranks)
        for r in range(ranks):
            live = [0] * (2 * ranks)
            for kind, _, c in _torch_zbv_order(ranks, m, r):
                live[c] += {"F": 1, "W": -1}.get(kind, 0)
                held[c] = max(held[c], live[c])
        assert inflight_counts("zbv", ranks, 2, m) == held


@settings(max_examples=300, deadline=None)
@given(_pipelines(), st.sampled_from([0.0, 0.3, 0.5, 1.0]))
def test_fast_paths_equal_the_event_loop(case, weight_share) -> None:
    """simulate() gives the former event loop's floats exactly, timelines included; step_times agrees row by row."""
    from _event_sim import simulate_events

    schedule, ranks, m, fwd, bwd, comm = case
    kw = dict(forward=fwd, backward=bwd, comm=comm, ranks=ranks, microbatches=m, weight_share=weight_share)
    fast, slow = simulate(schedule, **kw), simulate_events(schedule, **kw)
    assert fast == slow
    rows = step_times(schedule, forward=[fwd, bwd], backward=[bwd, fwd], comm=[comm, comm], ranks=ranks,
                      microbatches=m, weight_share=weight_share)  # fmt: skip
    swapped = simulate_events(schedule, **{**kw, "forward": bwd, "backward": fwd})
    assert rows.tolist() == [slow.step_time, swapped.step_time]


def test_fast_paths_equal_the_event_loop_on_real_valued_costs() -> None:
    """Random real-valued costs (ties are rare, rounding is not): identical floats on 200 pipelines."""
    import random

    from _event_sim import simulate_events

    rnd = random.Random(7)
    for _ in range(200):
        schedule = rnd.choice(["gpipe", "1f1b", "interleaved1f1b", "zbv"])
        ranks = rnd.randint(1, 6)
        virtual = {"gpipe": 1, "1f1b": 1, "zbv": 2}.get(schedule) or rnd.randint(2, 3)
        m = ranks * rnd.randint(1, 4) if schedule == "interleaved1f1b" else rnd.randint(1, 16)
        k = ranks * virtual
        kw = dict(forward=[rnd.random() for _ in range(k)], backward=[2 * rnd.random() for _ in range(k)],
                  comm=[rnd.random() / 10 for _ in range(k)], ranks=ranks, microbatches=m)  # fmt: skip
        assert simulate(schedule, **kw) == simulate_events(schedule, **kw), (schedule, ranks, m)
