"""Property tests: the solvers equal brute force over every cut (and recompute mode) on small random instances."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.errors import InfeasibleMemoryError
from autopipe.planner.bottleneck import NoBottleneckCut, StageCosts, solve

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
    except NoBottleneckCut:
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


# ---- the step-time partitioner: simulated step, every cut and every recompute mode by brute force ----

import numpy as np  # noqa: E402
from _event_sim import simulate_events  # noqa: E402

from autopipe import Profile as _Profile  # noqa: E402
from autopipe.costs.layer_costs import LayerCost  # noqa: E402
from autopipe.planner.chunk_costs import ChunkCosts  # noqa: E402
from autopipe.planner.partitioner import partition  # noqa: E402
from autopipe.planner.schedules import inflight_counts, peak_states  # noqa: E402
from autopipe.planner.step_bound import dwell_forms  # noqa: E402
from autopipe.planner.step_solver import NoCutFits as StepInfeasible  # noqa: E402
from autopipe.planner.step_solver import solve_step  # noqa: E402

STEP_SETTINGS = settings(max_examples=120, deadline=None)


@st.composite
def pipelines(draw, memory: bool, comm: bool):
    """A small profile and the options of one partition() call (schedule, stages, M, limit, recompute)."""
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved1f1b", "zbv"]))
    v = 2 if schedule in ("interleaved1f1b", "zbv") else 1
    n = draw(st.integers(v, 7))
    stages = draw(st.integers(1, n // v))
    m = stages * draw(st.integers(1, 2)) if schedule == "interleaved1f1b" else draw(st.integers(1, 5))
    small = st.integers(0, 6)
    # With a memory limit and communication both on, one cut size for every layer (a transformer's
    # hidden states): the receive buffers before a chunk then never shrink as it starts later, where
    # the partitioner is exact (elsewhere it is conservative: test_plans_never_exceed_the_limit).
    cut = draw(st.integers(0, 3))
    layers = tuple(
        LayerCost(index=i, name=f"l{i}", forward_time=float(draw(small)), backward_time=float(draw(small)),
                  param_bytes=draw(st.integers(0, 5)) if memory else 0, activation_bytes=draw(st.integers(0, 5)),
                  output_bytes=(cut if memory else draw(st.integers(0, 3))) if comm else 0)  # fmt: skip
        for i in range(n)
    )
    layers = tuple(replace(l, grad_bytes=l.param_bytes) for l in layers)  # sgd: no optimizer state
    if memory and schedule == "zbv":  # what a unit waiting for its weight pass holds, per mode: any size
        layers = tuple(replace(l, weight_hold_bytes={"none": draw(st.integers(0, 8)), "full": draw(st.integers(0, 8))})
                       for l in layers)  # fmt: skip
    prof = _Profile(layers=layers, optimizer="sgd", input_bytes=draw(st.integers(0, 3)))
    limit = draw(st.one_of(st.none(), st.integers(4, 60))) if memory else None
    recompute = draw(st.sampled_from(["none", "auto"])) if memory else "none"
    return prof, dict(schedule=schedule, microbatches=m, memory_limit=limit, bandwidth=1.0 if comm else None,
                      recompute=recompute), stages  # fmt: skip


def _brute_step(prof, opts, stages) -> float | None:
    """Least simulated step over every cut and every mode per chunk that fits, from the layers by hand."""
    schedule, m, limit = opts["schedule"], opts["microbatches"], opts["memory_limit"]
    v = 2 if schedule in ("interleaved1f1b", "zbv") else 1
    k = stages * v
    layers = prof.layers
    n = len(layers)
    bw = opts["bandwidth"] or float("inf")
    inputs = [prof.input_bytes] + [l.output_bytes for l in layers[:-1]]
    modes = ["none", "full"] if opts["recompute"] == "auto" else ["none"]
    # per chunk, the (held, waiting) states that can be its peak (zbv: waiting units are past their
    # B; without hold figures as heavy as held ones, but the model's output is gone)
    states = peak_states(schedule, stages, v, m)
    best = None
    for inner in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *inner, n)
        assignments = itertools.product(modes, repeat=k)
        if schedule == "zbv":
            # zbv's greedy order depends on the costs, so a longer op can reorder it and shorten the step;
            # recompute is never chosen for that: each chunk takes the fastest mode that fits, as planned.
            assignments = [tuple(_fastest_fitting(layers, inputs, a, b, states[c], limit, v, modes, m, schedule)
                                 for c, (a, b) in enumerate(zip(bounds, bounds[1:])))]  # fmt: skip
        for chosen in assignments:
            if None in chosen:
                continue
            fwd, bwd, comm, fits_all = [], [], [], True
            for c, ((a, b), mode) in enumerate(zip(zip(bounds, bounds[1:]), chosen)):
                part = layers[a:b]
                mem = max(_chunk_memory(layers, inputs, a, b, mode, h + w, m, w, schedule) for h, w in states[c])
                fits_all &= limit is None or mem <= limit // v
                cc = (layers[a - 1].output_bytes / bw if a > 0 else 0.0) + (layers[b - 1].output_bytes / bw if b < n else 0.0)
                fwd.append(sum(l.forward_time for l in part))
                redo = sum(l.forward_time for l in part) * (2 if schedule == "zbv" else 1)  # zbv: both backward passes
                bwd.append(sum(l.backward_time for l in part) + (redo if mode == "full" else 0.0))
                comm.append(cc)
            if not fits_all:
                continue
            step = simulate_events(schedule, forward=fwd, backward=bwd, comm=comm, ranks=stages, microbatches=m).step_time
            best = step if best is None else min(best, step)
    return best


def _chunk_memory(layers, inputs, a, b, mode, inflight, m, waiting=0, schedule="1f1b") -> int:
    """Bytes chunk [a, b) holds, by hand (autopipe.planner.memory's terms): parameters and gradients (SGD: no
    state), what each layer keeps per micro-batch in flight, the worst one-layer transient (under full
    recompute the activations it rebuilds beyond its input), the model's output held until its
    backward (last chunk; not by the ``waiting`` units past it), and one receive buffer per
    micro-batch on each side facing another chunk, twice under the schedules torch runs by its action
    runtime (interleaved, zbv), whose sends keep their tensors to the step's end."""
    part, n = layers[a:b], len(layers)
    kept = [l.activation_bytes for l in part] if mode == "none" else inputs[a:b]
    hold = [l.weight_hold_bytes.get(mode, k) for l, k in zip(part, kept)]  # a waiting unit's bytes
    mem = sum(2 * l.param_bytes for l in part) + (inflight - waiting) * sum(kept) + waiting * sum(hold)
    mem += max(max(l.activation_bytes - k, 0) for l, k in zip(part, kept)) if mode != "none" else 0
    mem += (inflight - waiting) * layers[-1].output_bytes if b == n else 0
    per_cut = m * (2 if schedule in ("interleaved1f1b", "zbv") else 1)
    mem += (per_cut * layers[a - 1].output_bytes if a > 0 else 0) + (per_cut * layers[b - 1].output_bytes if b < n else 0)
    return mem


def _fastest_fitting(layers, inputs, a, b, states, limit, v, modes, m, schedule="1f1b") -> str | None:
    """The mode with the least added time among those whose memory fits (none first on ties)."""
    part = layers[a:b]
    for mode in sorted(modes, key=lambda md: sum(l.forward_time for l in part) if md == "full" else 0.0):
        need = max(_chunk_memory(layers, inputs, a, b, mode, h + w, m, w, schedule) for h, w in states)
        if limit is None or need <= limit // v:
            return mode
    return None


@STEP_SETTINGS
@given(st.data())
def test_plans_never_exceed_the_limit(data) -> None:
    """Cut sizes that vary from layer to layer (where the partitioner's windows are conservative): every
    plan it returns still fits, chunk by chunk and rank by rank, in the memory model's exact bytes."""
    prof, opts, stages = data.draw(pipelines(memory=True, comm=True))
    sizes = data.draw(st.lists(st.integers(0, 9), min_size=len(prof.layers), max_size=len(prof.layers)))
    prof = replace(prof, layers=tuple(replace(l, output_bytes=c) for l, c in zip(prof.layers, sizes)))
    limit = opts["memory_limit"]
    try:
        plan = partition(prof, stages, **opts)
    except InfeasibleMemoryError:
        return
    if limit is not None:
        assert max(plan.stage_memory) <= limit // plan.virtual_stages
        if plan.virtual_stages == 1:
            assert plan.peak_memory <= limit
    layers, inputs = prof.layers, [prof.input_bytes] + [l.output_bytes for l in prof.layers[:-1]]
    for c, (a, b) in enumerate(zip(plan.boundaries, plan.boundaries[1:])):
        exact = _chunk_memory(layers, inputs, a, b, plan.recompute_of(c), plan.stage_inflight[c], plan.microbatches,
                              plan.stage_waiting[c], plan.schedule)
        assert plan.stage_memory[c] == exact


def _check_step(case) -> None:
    prof, opts, stages = case
    expected = _brute_step(prof, opts, stages)
    try:
        plan = partition(prof, stages, **opts)
    except InfeasibleMemoryError:
        assert expected is None
        return
    assert expected is not None
    assert plan.step_time == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert plan.step_lower_bound <= plan.step_time * (1 + 1e-9) and plan.step_gap == 0.0
    if opts["memory_limit"] is not None:
        assert max(plan.stage_memory) <= opts["memory_limit"] // plan.virtual_stages
    assert plan.simulate().step_time == plan.step_time  # the figures are those of the plan's own cut and modes


@STEP_SETTINGS
@given(pipelines(memory=False, comm=False))
def test_step_is_the_least_of_every_cut(case) -> None:
    """Every schedule: the plan's simulated step is the least any cut gives (brute force, old event loop)."""
    _check_step(case)


@STEP_SETTINGS
@given(pipelines(memory=False, comm=True))
def test_step_is_the_least_of_every_cut_with_communication(case) -> None:
    """With send/recv charged at each cut: still the least step of every cut."""
    _check_step(case)


@STEP_SETTINGS
@given(pipelines(memory=True, comm=True))
def test_step_is_the_least_of_every_cut_and_mode_under_memory(case) -> None:
    """Under memory limits, with recompute chosen per chunk: the least step over cuts x modes that fit, same feasibility.

    (zbv: over cuts, each chunk in its fastest fitting mode; see _brute_step.)"""
    _check_step(case)



@STEP_SETTINGS
@given(st.data())
def test_zbv_with_a_timed_split_is_the_least_of_every_cut(data) -> None:
    """zbv with the split's cost timed per layer: chunk 0 (torch's first stage, never split) costs its
    whole backward, every other chunk its backward times each layer's (B + W) / whole, at most the
    timed layers' together and at least 1. The solver's bounds read chunk 0's figures for every
    chunk: still the least step of every cut."""
    n = data.draw(st.integers(2, 7))
    stages = data.draw(st.integers(1, n // 2))
    m = data.draw(st.integers(1, 5))
    t = st.integers(1, 6)
    layers = tuple(
        LayerCost(index=i, name=f"l{i}", forward_time=float(data.draw(st.integers(0, 6))),
                  backward_time=float(data.draw(t)), backward_input_time=float(data.draw(t)),
                  backward_weight_time=float(data.draw(t)))  # fmt: skip
        for i in range(n)
    )
    prof = _Profile(layers=layers, optimizer="sgd")
    plan = partition(prof, stages, schedule="zbv", microbatches=m, bandwidth=None)
    share = prof.split_backward[0]
    together = prof.split_backward[1]
    ratio = [max(1.0, min((l.backward_input_time + l.backward_weight_time) / l.backward_time, together)) for l in layers]
    best = None
    for inner in itertools.combinations(range(1, n), 2 * stages - 1):
        bounds = (0, *inner, n)
        fwd = [sum(l.forward_time for l in layers[a:b]) for a, b in zip(bounds, bounds[1:])]
        bwd = [sum(l.backward_time * (1.0 if a == 0 else r) for l, r in zip(layers[a:b], ratio[a:b]))
               for a, b in zip(bounds, bounds[1:])]  # fmt: skip
        step = simulate_events("zbv", forward=fwd, backward=bwd, comm=[0.0] * len(fwd), ranks=stages,
                               microbatches=m, weight_share=share).step_time  # fmt: skip
        best = step if best is None else min(best, step)
    assert plan.step_time == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert plan.step_lower_bound <= plan.step_time * (1 + 1e-9)

@st.composite
def chunk_problems(draw):
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved1f1b", "zbv"]))
    v = 2 if schedule in ("interleaved1f1b", "zbv") else 1
    n = draw(st.integers(v, 8))
    stages = draw(st.integers(1, n // v))
    m = stages * draw(st.integers(1, 2)) if schedule == "interleaved1f1b" else draw(st.integers(1, 6))
    f = [float(draw(st.integers(0, 6))) for _ in range(n)]
    b = [float(draw(st.integers(0, 9))) for _ in range(n)]
    ow = [draw(st.sampled_from([0.0, 0.5, 1.0])) for _ in range(n - 1)]
    static = [draw(st.integers(0, 9)) for _ in range(n)]
    act = [draw(st.integers(0, 5)) for _ in range(n)]
    kept = [draw(st.integers(0, 2)) for _ in range(n)]
    costs = ChunkCosts(f, b, ow, static, act, (), {"full": (f, kept)})
    limit = draw(st.one_of(st.none(), st.integers(5, 60)))
    modes = draw(st.sampled_from([(0,), (0, 1)]))
    return costs, schedule, stages, v, m, limit, modes


def _brute_chunks(costs, schedule, stages, v, m, limit, modes) -> float | None:
    k = stages * v
    infl = inflight_counts(schedule, stages, v, m)
    best = None
    for inner in itertools.combinations(range(1, costs.n), k - 1):
        bd = (0, *inner, costs.n)
        for chosen in itertools.product(modes, repeat=k):
            pairs = list(zip(bd, bd[1:]))
            if limit is not None and any(costs.memory(a, b, infl[c], md) > limit for c, ((a, b), md) in enumerate(zip(pairs, chosen))):
                continue
            step = simulate_events(schedule, forward=[float(costs.forward(a, b)) for a, b in pairs],
                                   backward=[float(costs.backward(a, b, md)) for (a, b), md in zip(pairs, chosen)],
                                   comm=[float(costs.comm(a, b)) for a, b in pairs], ranks=stages, microbatches=m).step_time  # fmt: skip
            best = step if best is None else min(best, step)
    return best


@settings(max_examples=250, deadline=None)
@given(chunk_problems())
def test_lower_bound_holds_without_brute_force(problem) -> None:
    """Bounds and candidates only (no enumeration): the bound never exceeds the best cut, and 'exact' is true."""
    costs, schedule, stages, v, m, limit, modes = problem
    expected = _brute_chunks(costs, schedule, stages, v, m, limit, modes)
    try:
        sol = solve_step(costs, schedule, ranks=stages, virtual=v, microbatches=m, limit=limit, modes=modes, enumerate_work=0)
    except StepInfeasible:
        assert expected is None
        return
    assert expected is not None
    assert sol.lower_bound <= expected * (1 + 1e-9) + 1e-12
    assert sol.step >= expected * (1 - 1e-9) - 1e-12
    if sol.exact:
        assert sol.step == pytest.approx(expected, rel=1e-9, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(1, 6), st.integers(1, 10), st.data())
def test_dwell_paths_never_exceed_the_simulated_step(schedule, stages, m, data) -> None:
    """Each dwell path of the bound weighs no more than the simulated step, whatever the per-stage seconds."""
    fwd = [data.draw(st.floats(0, 5)) for _ in range(stages)]
    bwd = [data.draw(st.floats(0, 5)) for _ in range(stages)]
    comm = [data.draw(st.sampled_from([0.0, 0.3])) for _ in range(stages)]
    step = simulate_events(schedule, forward=fwd, backward=bwd, comm=comm, ranks=stages, microbatches=m).step_time
    F = [f + c for f, c in zip(fwd, comm)]
    B = [b + c for b, c in zip(bwd, comm)]
    for s, forms in enumerate(dwell_forms(schedule, stages, m, max(F), max(B))):  # the cut's own max F, max B
        for f in forms:
            w = (f.pf * sum(F[:s]) + f.pb * sum(B[:s]) + f.cf * F[s] + f.cb * B[s] + f.qf * sum(F[s + 1 :])
                 + f.qb * sum(B[s + 1 :]) + f.const)  # fmt: skip
            assert w <= step * (1 + 1e-9) + 1e-9, (s, f)


def test_interleaved_minimises_the_step_not_the_slowest_chunk() -> None:
    """[2, 5, 1, 2, 8, 3], 2 stages x 2 virtual, 4 micro-batches: (0,1,4,5,6) steps 48.3; the least slowest chunk 64."""
    prof = _Profile.from_costs([2, 5, 1, 2, 8, 3])
    plan = partition(prof, 2, virtual_stages=2, microbatches=4, schedule="interleaved1f1b", bandwidth=None)
    assert plan.boundaries == (0, 1, 4, 5, 6)
    assert plan.step_time == pytest.approx(48 + 1 / 3) and plan.step_gap == 0.0
    slowest_chunk = partition(prof, 2, virtual_stages=2, microbatches=4, schedule="interleaved1f1b", bandwidth=None,
                              boundaries=[0, 3, 4, 5, 6])  # fmt: skip
    assert slowest_chunk.step_time == pytest.approx(64.0)
    assert plan.bottleneck_time == slowest_chunk.bottleneck_time == 8.0  # the same slowest chunk ...
    assert plan.rank_times == (10.0, 11.0) and slowest_chunk.rank_times == (16.0, 5.0)  # ... not the same ranks


def test_bound_and_gap_at_scale() -> None:
    """300 layers x 8 stages (too many cuts to try): a plan within its recorded gap of the bound."""
    rng = np.random.default_rng(0)
    prof = _Profile.from_costs(list(rng.lognormal(0.0, 0.3, 300)), output_bytes=[10**6] * 300)
    plan = partition(prof, 8, microbatches=16)
    assert plan.step_lower_bound is not None and 0 < plan.step_lower_bound <= plan.step_time
    assert plan.step_gap == pytest.approx(plan.step_time / plan.step_lower_bound - 1, abs=1e-9)
    assert plan.step_gap < 0.01  # the round-trip bound is tight for 1F1B on fine-grained layers
    uniform = partition(prof, 8, microbatches=16, method="uniform")
    assert uniform.step_time >= plan.step_lower_bound


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2), ("zbv", 2)])
def test_free_layers_with_costly_cuts(schedule, virtual) -> None:
    """Layers that take no time but cuts that do: the bound search starts from 0 and still ends, within its bound."""
    costs = ChunkCosts([0.0] * 12, [0.0] * 12, [0.5] * 11)
    sol = solve_step(costs, schedule, ranks=2, virtual=virtual, microbatches=4, enumerate_work=0)
    best = solve_step(costs, schedule, ranks=2, virtual=virtual, microbatches=4)  # all 165 or 11 cuts
    assert best.exact and sol.lower_bound <= best.step <= sol.step
