"""The cluster search (autopipe/cluster/layout_search.py): exact against solving every layout, bounds that hold,
the reduction overlapping the cooldown, micro-batch scaling, and what it says when nothing fits."""

from __future__ import annotations

import os

import random

import pytest

from autopipe import Profile
from autopipe.cluster.evaluate import SearchBounds, evaluate
from autopipe.cluster.layout_search import search
from autopipe.cluster.layouts import Layout, SearchResult, enumerate_layouts
from autopipe.cluster.topology import Cluster
from autopipe.costs.rescale import scale_microbatch
from autopipe.errors import AutopipeError, InfeasibleMemoryError

# Two nodes of two devices: intra-node links ten times the inter-node ones, so placement matters.
CLUSTER = Cluster(gpus=4, gpus_per_node=2, intra=2000.0, inter=200.0)


def _profile(seed: int) -> Profile:
    rng = random.Random(seed)
    n = 6
    return Profile.from_costs(
        [rng.uniform(0.5, 3.0) for _ in range(n)],
        param_bytes=[rng.randrange(50, 400) for _ in range(n)],
        activation_bytes=[rng.randrange(20, 120) for _ in range(n)],
        output_bytes=[rng.randrange(10, 60) for _ in range(n - 1)] + [0],
    )


def _solve_all(prof: Profile, limit: int | None, cache: dict | None) -> list[Layout]:
    """Every layout solved (no bound, no pruning), best first, by the search's own evaluator."""
    out = []
    for x in enumerate_layouts(len(prof.layers), CLUSTER, 8):
        try:
            done, _ = evaluate(prof, CLUSTER, x, memory_limit=limit, cache=cache)
        except InfeasibleMemoryError:
            continue
        out.append(done)
    return sorted(out, key=lambda x: -(x.throughput or 0.0))


def _binding_limit(prof: Profile) -> int:
    free = [x.peak_memory or 0 for x in _solve_all(prof, None, {})]
    return int(min(free) + 0.3 * (max(free) - min(free)))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_returns_the_best_layouts_of_brute_force(seed: int) -> None:
    """With a binding memory limit, the pruned search's top layouts have exactly the throughputs of
    the best of every layout solved (so pruning never drops the optimum); ZeRO 3, left out beside 2,
    never steps faster than its ZeRO 2 twin."""
    prof = _profile(seed)
    limit = _binding_limit(prof)
    brute = _solve_all(prof, limit, {})
    assert brute and len(brute) < len(_solve_all(prof, None, {}))  # the limit binds
    res = search(prof, CLUSTER, global_batch=8, memory_limit=limit, top=3)
    by_key = {x.key(): x for x in brute}
    for x in brute:
        if x.dp > 1 and x.zero == 3:
            twin = by_key[x.key()[:6] + (2,) + x.key()[7:]]
            assert twin.throughput >= x.throughput, x
    kept = [x for x in brute if x.dp == 1 or x.zero != 3]
    got = [x.throughput for x in res.layouts[:3]]
    assert got == pytest.approx([x.throughput for x in kept[:3]], rel=1e-9)
    assert res.best is not None and res.best.peak_memory <= limit
    assert res.plan is not None and res.plan.dp == res.best.dp and res.plan.zero == res.best.zero
    assert res.plan.stages == res.best.stages and res.plan.microbatches == res.best.microbatches
    assert res.solved < res.considered  # something was pruned
    assert res.considered == res.pruned_memory + res.pruned_dominated + res.pruned_bound + res.solved


@pytest.mark.parametrize("seed", [0, 1])
def test_a_search_on_several_workers_keeps_the_best_layouts(seed: int) -> None:
    """Solving layouts on 3 forked workers (each result raising the bar for the layouts handed out after it)
    gives the same top layouts, best plan and cut as solving them in this process, and as brute force;
    every layout is still counted once (solved or pruned)."""
    prof = _profile(seed)
    limit = _binding_limit(prof)
    one = search(prof, CLUSTER, global_batch=8, memory_limit=limit, workers=1)
    many = search(prof, CLUSTER, global_batch=8, memory_limit=limit, workers=3)
    brute = [x for x in _solve_all(prof, limit, {}) if x.dp == 1 or x.zero != 3]
    assert [x.throughput for x in many.layouts[:3]] == pytest.approx([x.throughput for x in brute[:3]], rel=1e-9)
    assert [x.key() for x in many.layouts[:3]] == [x.key() for x in one.layouts[:3]]
    assert many.best.boundaries == one.best.boundaries and many.best.step_time == one.best.step_time
    assert many.plan is not None and many.plan.boundaries == one.plan.boundaries
    assert many.considered == many.pruned_memory + many.pruned_dominated + many.pruned_bound + many.solved
    assert many.considered == one.considered and many.solved >= 1
    with pytest.raises(AutopipeError, match="workers must be 1 or more"):
        search(prof, CLUSTER, global_batch=8, memory_limit=limit, workers=0)


def _dies_on_replicas(x: Layout, kth: float | None) -> tuple:
    """A search worker's task that kills its worker on any layout with replicas (picklable: module level)."""
    import autopipe.cluster.layout_search as layout_search

    if x.dp > 1:
        os._exit(9)
    assert layout_search._WORKER is not None
    return layout_search._WORKER.solve(x, kth)


def test_a_search_whose_worker_dies_finishes_in_process_with_the_same_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker killed mid-search (the OS's out-of-memory killer picks large processes, and a forked copy of a
    large one is one): the answers in stand, the layouts left are solved in this process, one warning says
    so, and the top layouts, best cut and plan are those of a search in one process."""
    import autopipe.cluster.layout_search as layout_search

    prof = _profile(0)
    limit = _binding_limit(prof)
    one = search(prof, CLUSTER, global_batch=8, memory_limit=limit, workers=1)
    monkeypatch.setattr(layout_search, "_solve_in_worker", _dies_on_replicas)
    with pytest.warns(RuntimeWarning, match="a layout-search worker died; solving the [0-9]+ layouts left in this process"):
        got = search(prof, CLUSTER, global_batch=8, memory_limit=limit, workers=3)
    assert [x.key() for x in got.layouts[:3]] == [x.key() for x in one.layouts[:3]]
    assert got.best.boundaries == one.best.boundaries and got.plan.boundaries == one.plan.boundaries
    assert got.considered == got.pruned_memory + got.pruned_dominated + got.pruned_bound + got.solved


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shared_unlimited_cut_is_partitions_optimum(seed: int) -> None:
    """The evaluator's shortcut (the cut solved without a limit, kept where it fits) gives every
    layout the pipeline step partition gives it with the limit, and the same verdict on fitting."""
    prof = _profile(seed)
    limit = _binding_limit(prof)
    cache: dict = {}
    for x in enumerate_layouts(len(prof.layers), CLUSTER, 8):
        got = want = None
        try:
            got, _ = evaluate(prof, CLUSTER, x, memory_limit=limit, cache=cache)
        except InfeasibleMemoryError:
            pass
        try:
            want, _ = evaluate(prof, CLUSTER, x, memory_limit=limit)
        except InfeasibleMemoryError:
            pass
        assert (got is None) == (want is None), x
        if got is not None and want is not None:
            assert got.pipeline_time == pytest.approx(want.pipeline_time, rel=1e-9), x
            assert got.peak_memory <= limit
            if (got.boundaries, got.recompute) == (want.boundaries, want.recompute):
                assert got.peak_memory == want.peak_memory, x


@pytest.mark.parametrize("limit", [None, 10**6])
def test_the_shortcut_charges_a_multi_chunk_rank_its_chunks_joint_peak(limit: int | None) -> None:
    """Where the unlimited cut is kept (no limit, or one that does not bind), the layout's peak is the
    plan's: interleaved and zbv ranks at their chunks' joint peak, not the sum of each chunk's own
    (which read over the plan on 16 of these 40 layouts before)."""
    prof = _profile(0)
    cache: dict = {}
    multi = 0
    for x in enumerate_layouts(len(prof.layers), CLUSTER, 8):
        if x.virtual_stages == 1:
            continue
        got, plan = evaluate(prof, CLUSTER, x, memory_limit=limit, cache=cache)
        want, solved = evaluate(prof, CLUSTER, x, memory_limit=limit)
        assert plan is None and solved is not None  # the first took the shortcut, the second solved
        assert got.boundaries == want.boundaries and got.peak_memory == want.peak_memory == solved.peak_memory, x
        multi += 1
    assert multi == 40


def test_bounds_hold_for_every_layout() -> None:
    """The throughput bound is never below a layout's solved throughput, and every layout the memory
    bound refuses has no cut that fits."""
    prof = _profile(3)
    limit = 2600
    bounds = SearchBounds(prof, None, limit, CLUSTER)
    refused = 0
    for x in enumerate_layouts(len(prof.layers), CLUSTER, 8):
        try:
            done, _ = evaluate(prof, CLUSTER, x, memory_limit=limit)
        except InfeasibleMemoryError:
            done = None
        scale = float(x.microbatch_size)
        if not bounds.fits(x, scale):
            refused += 1
            assert done is None, x
        if done is not None:
            assert done.throughput <= bounds.throughput(x, scale) * (1 + 1e-9), x
    assert refused > 0


def test_reduction_overlaps_the_cooldown() -> None:
    """2 stages, 1 micro-batch, 2 replicas (a 1-second layer each, forward a third): rank 1 ends its
    backward at 4/3 s and rank 0 at 2 s. Rank 0 reduces 10 B and rank 1 100 B over 100 B/s
    (all-reduce over 2: 2·1/2 of the bytes): 0.1 s and 1 s, so the step is max(2.1, 4/3 + 1) = 7/3 s."""
    prof = Profile.from_costs([1.0, 1.0], param_bytes=[10, 100])
    cluster = Cluster(gpus=4, gpus_per_node=4, intra=100.0, inter=100.0)
    x = Layout(2, 2, 1, 1, "1f1b", 1, 0, "pipeline-inner")
    done, plan = evaluate(prof, cluster, x, memory_limit=None)
    assert done.pipeline_time == pytest.approx(2.0)
    assert done.reduce_time == pytest.approx(1.0)
    assert done.step_time == pytest.approx(7 / 3)
    assert done.throughput == pytest.approx(2 / (7 / 3))  # 1 sample per micro-batch x 1 x 2 replicas
    assert plan is not None and plan.dp == 2


def test_microbatch_scaling_is_linear_in_samples() -> None:
    """Twice the samples: times, activations, outputs and temporaries double; weights, gradients and
    optimizer state do not."""
    prof = Profile.from_costs([3.0], param_bytes=[100], activation_bytes=[40], output_bytes=[8])
    two = scale_microbatch(prof, 2)
    a, b = prof.layers[0], two.layers[0]
    assert (b.forward_time, b.backward_time) == (2 * a.forward_time, 2 * a.backward_time)
    assert (b.activation_bytes, b.output_bytes) == (80, 16)
    assert (b.param_bytes, b.grad_bytes, b.optimizer_bytes) == (a.param_bytes, a.grad_bytes, a.optimizer_bytes)
    assert b.peak_backward_bytes - b.grad_bytes == 2 * max(a.peak_backward_bytes - a.grad_bytes, 0)


def test_nothing_fits_says_what_would_in_one_line() -> None:
    """A limit below every layout names a larger cluster or the memory per device that fits."""
    prof = _profile(0)
    with pytest.raises(InfeasibleMemoryError) as err:
        search(prof, CLUSTER, global_batch=8, memory_limit=700)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("no layout of 4 devices fits")
    assert "devices would fit" in msg or "per device would fit" in msg


def test_result_saves_and_loads(tmp_path) -> None:
    """search.json round-trips every layout and count (the Plan is saved apart, as plan.json)."""
    res = search(_profile(1), CLUSTER, global_batch=8, memory_limit=None)
    path = tmp_path / "search.json"
    res.save(str(path))
    back = SearchResult.load(str(path))
    assert back.layouts == res.layouts and back.considered == res.considered and back.plan is None
