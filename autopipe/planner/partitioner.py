"""The partition pass: Profile + stages + schedule + memory limit -> Plan.

This module turns a profile into per-chunk costs (autopipe/planner/cost_model.py over
autopipe/planner/chunk_costs.py), asks the step-time partitioner (autopipe/planner/step_solver.py, which
owns the algorithm) for the cut, applies user overrides and baselines, and fills the Plan; a limit
nothing fits is explained by autopipe/planner/refusals.py.

Objective: the simulated step of the schedule that will run (schedules.simulate), not the slowest
chunk. Cost model, per micro-batch. A chunk ``[a, b)`` takes its layers' forward and backward time
plus, at each cut it touches, the tuple crossing that cut once forward (activations) and once
backward (their gradients) at ``bandwidth`` bytes/s. It holds its parameters, gradients and optimizer
state (a tied tensor once per chunk holding it) plus its activation bytes times the micro-batches the
schedule keeps in flight there: M for GPipe, min(S - s, M) for 1F1B, read off the op order for
interleaved and for zbv (torch's ZBVZeroBubble order; see schedules.inflight_counts; a zbv unit
past its input pass holds its measured hold until its weight pass, and each chunk is held under
the limit in every state that can be its peak, schedules.peak_states). With v
virtual stages per rank each chunk must fit ``memory_limit / v`` (sufficient for the rank).

Recompute, per chunk: "none" keeps every activation; "full" keeps each layer's input and runs its
forward again in backward; "selective" keeps what the profile measured for that mode (a layer with no
selective figures keeps everything, as under none). Under a recompute mode a chunk also holds the
plain activations of the one layer it is recomputing. A layer with no "full" figures (older profiles)
keeps its input (the previous layer's output bytes, or the profile's input bytes) and adds its forward
time. ``recompute="auto"`` lets each chunk take the fastest mode that fits; the others force one mode.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..choices import RECOMPUTE_POLICIES, ZERO_STAGES
from ..costs.engines import EngineCosts, engine_costs
from ..costs.layer_costs import Profile
from ..errors import AutopipeError, InfeasibleMemoryError, PartitionError
from ..units import format_bytes, parse_size
from .baselines import BASELINES, baseline
from .chunk_costs import state_arrays
from .cost_model import CostModel, CutRequest, unit_states
from .memory import charged_units, rank_memory
from .plan import Plan
from .refusals import chunk_need, explain_infeasible, recompute_hint, with_zero_hint
from .schedules import (
    check_schedule,
    check_weight_share,
    chunk_ranks,
    normalize_schedule,
    shared_step,
    simulate,
)
from .step_bound import fits
from .step_solver import TIE, NoCutFits, StepSolution, solve_step
from .targets import (
    check_cut_allowed,
    check_target,
    explain_restricted,
    restricted_cuts,
    target_info,
)

__all__ = ["partition", "compare_baselines", "fits_memory", "resolve_limit", "zero_choices", "check_bounds",
           "names_to_bounds", "DEFAULT_BANDWIDTH"]

# PCIe 4.0 x16 in practice: the slowest link a pipeline commonly crosses inside one machine.
DEFAULT_BANDWIDTH = 25e9


def partition(
    profile: Profile,
    stages: int,
    *,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    memory_limit: int | str | None = "device",
    optimizer: str | None = None,
    virtual_stages: int | None = None,
    bandwidth: float | None = DEFAULT_BANDWIDTH,
    boundaries: Sequence[int] | None = None,
    stage_names: Sequence[Sequence[str]] | None = None,
    method: str = "autopipe",
    weight_share: float | None = None,
    recompute: str = "auto",
    dp: int = 1,
    zero: int | str = 0,
    cuts: Sequence[int] | None = None,
    target: str | None = None,
    engine: str | EngineCosts | None = None,
) -> Plan:
    """Cut a profiled layer sequence into pipeline stages so the schedule's step is as short as possible.

    Args:
        profile: per-layer costs (``autopipe.profile`` or ``Profile.from_costs``).
        stages: pipeline ranks S.
        microbatches: micro-batches per step M (default 2·S).
        schedule: gpipe, 1f1b, interleaved1f1b or zbv: the schedule simulated (and minimised), and
            the in-flight activations per stage.
        memory_limit: bytes per device, or a size like "80GiB"; None or "none": unlimited; "device"
            (the default): the memory of the GPU the profile was measured or estimated for, unlimited
            for a CPU profile (ranks on one host share its memory; give a limit).
        optimizer: recount optimizer state for this optimizer (default: the profile's).
        virtual_stages: chunks per rank v (default 1; 2 for interleaved1f1b and zbv). The model is
            cut into S·v chunks.
        bandwidth: bytes/s between neighbouring ranks; None: ignore communication.
        boundaries: your own cut (S·v + 1 layer indices); the plan reports the optimum beside it.
        stage_names: your own cut as layer/module names per chunk (a name covers the layers it
            prefixes, e.g. "transformer.h.0").
        method: "autopipe" (the step-time search), or a baseline: uniform, parameters, type:REGEX,
            torchtitan, greedy.
        weight_share: part of the backward that zero-bubble schedules split off as W (default: the
            profile's measured split, ``Profile.split_backward``; 0.5 when it was not measured).
        recompute: "none", "full", "selective" (that mode in every chunk) or "auto" (the default:
            each chunk the fastest mode that fits the memory limit, so none where nothing binds).
        dp: data-parallel replicas of each stage (the job's ``--dp``); memory is per rank.
        zero: ZeRO stage 0-3 across those replicas (what each rank shards, autopipe.planner.memory), or
            "auto": the stage whose plan steps fastest under the limit, the lowest on a tie (ZeRO
            0 where nothing binds).
        cuts: the only layer indices (1..L-1) a chunk may start at; the plan records them and the
            step of the best unrestricted cut beside its own (``unrestricted_step_time``).
        target: plan for an engine that splits by module: torchtitan, megatron, deepspeed or fqns
            (autopipe.planner.targets): only the cuts it allows (with ``cuts``, those of both), and
            only what it can run (its schedules, virtual stages, ZeRO stages).
        engine: the engine the job trains on (torch or deepspeed): its measured seconds per op, per
            send and per step (autopipe.costs.engines) join the layers' in the cost model, so the
            cut is the best for that engine; its measured P2P bandwidth replaces the default link.
            None, or an engine not measured on the profile's device: the layers alone. An
            ``EngineCosts`` record instead of a name plans with those figures (what-ifs, and the
            bench that fits them).

    Returns:
        A :class:`~autopipe.planner.plan.Plan`; ``plan.step_lower_bound`` is a proven bound on the step of
        every cut (equal to ``plan.step_time`` when the cut is proven optimal).

    Raises:
        InfeasibleMemoryError: no cut fits; the message says what would (recompute, stages, memory).
        PartitionError: bad options or boundaries.

    Example:
        >>> prof = Profile.from_costs([1, 4, 4, 4, 4, 3])
        >>> plan = partition(prof, 3, bandwidth=None)
        >>> plan.boundaries, round(plan.step_time, 6), plan.step_gap
        ((0, 2, 4, 6), 59.0, 0.0)
    """
    n = len(profile.layers)
    if n == 0:
        raise PartitionError("the profile has no layers.")
    if str(schedule).strip().lower() == "auto":  # a choice among plans, made one level up
        raise PartitionError("partition plans one schedule; for schedule='auto' call "
                             "autopipe.planner.plan_schedules(profile, stages, ...), which plans each and keeps the fastest.")
    if target is not None and recompute == "auto" and not target_info(target).per_stage_recompute:
        # the engine applies one mode to every stage: the fastest single mode that fits, set against
        # autopipe's own plan (any cut, each chunk its own mode): what planning for the engine costs
        def plan_with(mode: str, cut_for: str | None = target) -> Plan:
            return partition(profile, stages, microbatches=microbatches, schedule=schedule, memory_limit=memory_limit,
                             optimizer=optimizer, virtual_stages=virtual_stages, bandwidth=bandwidth,
                             boundaries=boundaries, stage_names=stage_names, method=method, weight_share=weight_share,
                             recompute=mode, dp=dp, zero=zero, cuts=cuts, target=cut_for, engine=engine)  # fmt: skip

        plan = _one_mode(target_info(target).recompute, plan_with)
        if plan.method != "autopipe" or cuts is not None:
            return plan
        try:
            free = plan_with("auto", None)
        except InfeasibleMemoryError:
            return plan
        return replace(plan, unrestricted_step_time=free.step_time, unrestricted_boundaries=free.boundaries)
    schedule = normalize_schedule(schedule)
    # `is None`, not `or`: 0 is a mistake to report, not a request for the default.
    v = virtual_stages if virtual_stages is not None else (2 if schedule in ("interleaved1f1b", "zbv") else 1)
    m = microbatches if microbatches is not None else 2 * max(stages, 1)
    schedule = check_schedule(schedule, stages, v, m)
    engine_name = engine.engine if isinstance(engine, EngineCosts) else engine
    if engine_name == "torch" and schedule == "1f1b" and m < stages:
        # torch's Schedule1F1B refuses it when the job starts; DeepSpeed's 1F1B and Megatron's run it
        raise PartitionError(f"1f1b on torch's engine needs at least as many micro-batches as stages ({m} < {stages}): "
                             f"use --microbatches {stages} or more, or gpipe.")
    if weight_share is None:
        split = profile.split_backward
        weight_share = split[0] if split is not None else 0.5
    check_weight_share(weight_share)
    if recompute not in RECOMPUTE_POLICIES:
        raise PartitionError(f"recompute={recompute!r}; use one of {', '.join(RECOMPUTE_POLICIES)}.")
    k = stages * v
    if k > n:
        raise PartitionError(
            f"cannot cut {n} layers into {k} non-empty chunks ({stages} stages x {v} virtual); "
            f"use at most {n // v} stages."
        )
    limit, limit_source = resolve_limit(profile, memory_limit)
    zeros = zero_choices(zero, dp)
    if boundaries is not None and stage_names is not None:
        raise PartitionError("give boundaries or stage_names, not both.")
    if target is not None:
        check_target(target, schedule=schedule, virtual_stages=v, dp=dp)
        zeros = [z for z in zeros if dp == 1 or z in target_info(target).zeros] or zeros
        if len(zeros) == 1:
            check_target(target, schedule=schedule, virtual_stages=v, zero=zeros[0], dp=dp)
    allowed = restricted_cuts(profile, k, cuts, target)

    request = CutRequest(stages=stages, v=v, m=m, schedule=schedule, limit=limit, limit_source=limit_source,
                       recompute=recompute, weight_share=weight_share, states=unit_states(schedule, stages, v, m),
                       signature=profile.signature, zero_policy=str(zero),
                       cuts=None if allowed is None else allowed.cuts, target=target_info(target).key if target else "")  # fmt: skip

    costs = engine if isinstance(engine, EngineCosts) else engine_costs(engine, profile.device.type)
    if costs is not None:
        costs = costs.on_host(profile.device.host_probe)  # the table's runtime seconds, on this profile's host
    if costs is not None and costs.bandwidth is not None and bandwidth == DEFAULT_BANDWIDTH:
        bandwidth = costs.bandwidth  # the engine's measured link, not a GPU's PCIe guess

    def attempt(z: int) -> Plan:
        model = CostModel(profile, optimizer, bandwidth, schedule, m, dp=dp, zero=z, engine=costs)
        return _partition_one(profile, model, request, boundaries=boundaries, stage_names=stage_names, method=method)

    plans: list[Plan] = []
    failure: InfeasibleMemoryError | None = None
    for z in zeros:
        try:
            plans.append(attempt(z))
        except InfeasibleMemoryError as e:
            failure = e
    if not plans:
        assert failure is not None
        raise with_zero_hint(failure, attempt, zeros, dp)
    if len(plans) == 1:
        return plans[0]
    fitting = [p for p in plans if limit is None or p.peak_memory <= limit]
    if method == "autopipe" and boundaries is None and stage_names is None:
        # the fastest step; on a tie the lowest stage (the least communication and state to gather)
        best = min(p.step_time for p in fitting or plans)
        return next(p for p in fitting or plans if p.step_time <= best * (1 + TIE))
    # a cut the user or a baseline fixed: the lowest stage under which it fits, else the most sharded
    return fitting[0] if fitting else plans[-1]


def _one_mode(modes: Sequence[str], plan_with) -> Plan:  # noqa: ANN001
    """The plan of the recompute mode (one for every chunk) whose step is the least; the first on a tie
    (modes go none, selective, full). A mode the profile has no figures for is passed over. Raises the
    last refusal when no mode fits (a bad option fails in every mode alike)."""
    best: Plan | None = None
    failure: PartitionError | None = None
    for mode in modes:
        try:
            plan = plan_with(mode)
        except PartitionError as e:  # no fit, or no figures for this mode
            failure = e
            continue
        if best is None or plan.step_time < best.step_time * (1 - TIE):
            best = plan
    if best is None:
        assert failure is not None
        raise failure
    return replace(best, recompute="auto")


def compare_baselines(profile: Profile, plan: Plan) -> dict[str, Plan]:
    """The baselines' plans for the same profile, stages, schedule, micro-batches, bandwidth, optimizer and engine.

    A baseline that cannot be made (e.g. fewer layers than it needs) is left out; one that breaks the
    memory limit is kept (the report marks it), because that is exactly what the comparison shows.
    """
    out: dict[str, Plan] = {}
    bandwidth = None if plan.bandwidth == float("inf") else plan.bandwidth
    for method in BASELINES:
        try:
            out[method] = partition(
                profile, plan.stages, microbatches=plan.microbatches, schedule=plan.schedule,
                memory_limit=plan.memory_limit, virtual_stages=plan.virtual_stages, bandwidth=bandwidth,
                method=method, weight_share=plan.weight_share, optimizer=plan.optimizer, recompute=plan.recompute,
                dp=plan.dp, zero="auto" if plan.zero_policy == "auto" else plan.zero, engine=plan.engine or None,
            )  # fmt: skip
        except AutopipeError:
            continue
    return out


def fits_memory(profile: Profile, stages: int, *, microbatches: int, schedule: str = "1f1b",
                virtual_stages: int = 1, memory_limit: int | str | None = "device", optimizer: str | None = None,
                recompute: str = "auto", dp: int = 1, zero: int = 0, cuts: Sequence[int] | None = None) -> bool:  # fmt: skip
    """Whether ``partition`` with these options finds a cut that fits (at one fixed ZeRO stage), without
    searching for the fastest: the memory reachability the solver starts with (step_bound.fits). The
    cluster search (autopipe/cluster/layout_search.py) asks this before paying for a solve, or for an explanation.
    ``cuts``: only those layers may start a chunk (an engine's, autopipe.planner.targets)."""
    limit, _ = resolve_limit(profile, memory_limit)
    if limit is None:
        return True
    model = CostModel(profile, optimizer, None, schedule, microbatches, dp=dp, zero=zero)
    chunk_limit = model.budget(limit, stages) // virtual_stages
    states = unit_states(schedule, stages, virtual_stages, microbatches)
    costs = model.costs if cuts is None else model.costs.restrict(cuts)
    k = stages * virtual_stages
    return chunk_limit > 0 and k <= costs.n and fits(costs, k, limit=chunk_limit, modes=model.allowed(recompute),
                                                     states=states)  # fmt: skip


def zero_choices(zero: int | str, dp: int) -> list[int]:
    """The ZeRO stages to try: the one given, or all four for "auto" (only 0 without replicas)."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise PartitionError(f"dp={dp!r}: the data-parallel replicas must be a whole number >= 1.")
    if isinstance(zero, str) and zero.strip().lower() == "auto":
        return [0] if dp == 1 else list(ZERO_STAGES)
    try:
        z = int(zero)
    except (TypeError, ValueError):
        z = -1
    if z not in ZERO_STAGES or isinstance(zero, bool) or (isinstance(zero, float) and zero != z):
        raise PartitionError(f"zero={zero!r}; use a ZeRO stage 0, 1, 2 or 3, or 'auto'.")
    return [z]


def resolve_limit(profile: Profile, memory_limit: int | str | None) -> tuple[int | None, str]:
    """The per-device limit in bytes (None: unlimited) and where it came from ("given", "device", "").

    "device" is the profile's GPU memory: what torch reported when measured on CUDA, the device
    table's figure when estimated for one. A CPU profile has no default: its ranks usually share one
    host's memory, which the profile cannot divide for them.
    """
    if memory_limit is None or (isinstance(memory_limit, str) and memory_limit.strip().lower() == "none"):
        return None, ""
    if isinstance(memory_limit, str) and memory_limit.strip().lower() == "device":
        dev = profile.device
        if dev.type == "cuda" and dev.memory_bytes > 0:
            return int(dev.memory_bytes), "device"
        return None, ""
    return parse_size(memory_limit), "given"


def _partition_one(profile: Profile, model: CostModel, req: CutRequest, *, boundaries: Sequence[int] | None,
                   stage_names: Sequence[Sequence[str]] | None, method: str) -> Plan:
    """The plan for one ZeRO stage (the model's): see partition()."""
    n = len(profile.layers)
    limit, k, states = req.limit, req.stages * req.v, req.states
    # the runtime's own fixed terms first (reserve; on a GPU context, workspaces, NCCL, the
    # allocator's slack), then each of a rank's v chunks gets a share of the rest
    chunk_limit = None if limit is None else model.budget(limit, req.stages) // req.v
    if chunk_limit is not None and chunk_limit <= 0:
        fixed = limit - model.budget(limit, req.stages)
        raise InfeasibleMemoryError(
            f"a memory limit of {format_bytes(limit)} per device leaves nothing for the model: the runtime itself "
            f"holds {format_bytes(fixed)} per rank on this device (the profile's reserve, and on a GPU its context, "
            "workspaces and NCCL buffers). Raise the limit."
        )
    allowed = model.allowed(req.recompute)

    chosen: tuple[int, ...] | None = None
    if boundaries is not None or stage_names is not None:
        chosen = check_bounds(boundaries, n, k) if boundaries is not None else names_to_bounds(stage_names, model.names, k)
        method = "manual"
    elif method != "autopipe":
        chosen = baseline(method, k, times=profile.times, params=model.params, names=model.names)

    if chosen is not None and req.cuts is not None:
        check_cut_allowed(chosen, req.cuts, model.names, req.target, method)
    best: StepSolution | None = None

    def solve(cuts: tuple[int, ...] | None) -> StepSolution:
        return solve_step(model.costs, req.schedule, ranks=req.stages, virtual=req.v, microbatches=req.m, states=states,
                          limit=chunk_limit, modes=allowed, weight_share=req.weight_share, cuts=cuts)  # fmt: skip

    try:
        best = solve(req.cuts)
    except NoCutFits:
        if chosen is None:
            what = (f"the {profile.device.name}'s {format_bytes(limit)} (its memory, the default limit)"
                    if req.limit_source == "device" else f"{format_bytes(limit)} per device")  # fmt: skip
            if req.cuts is not None:
                raise explain_restricted(explain_infeasible(model, req, chunk_limit, what), req.target) from None
            raise explain_infeasible(model, req, chunk_limit, what) from None
    if chosen is None:
        assert best is not None
        plan = _make_plan(model, req, best.boundaries, method="autopipe", modes=best.modes, bound=best.lower_bound)
        if req.cuts is not None:  # what the restriction costs: the best cut the engine cannot make
            free = solve(None)
            plan = replace(plan, unrestricted_step_time=free.step, unrestricted_boundaries=free.boundaries)
        return plan
    units, waits = state_arrays(states)
    modes = model.costs.fastest_modes(np.array(chosen[:-1]), np.array(chosen[1:]), units[:, 0], chunk_limit, allowed,
                                      waits[:, 0])  # fmt: skip
    if method == "manual" and chunk_limit is not None and np.any(modes < 0):
        c = int(np.flatnonzero(modes < 0)[0])
        a, b = chosen[c], chosen[c + 1]
        need = min(chunk_need(model.costs, a, b, states[c], md) for md in allowed)
        hint = recompute_hint(model, req.recompute, [(a, b, states[c])], chunk_limit)
        raise InfeasibleMemoryError(
            f"your chunk {c} (layers {a}..{b - 1}) needs {format_bytes(need)}, more than the "
            f"{format_bytes(chunk_limit)} it may use; move layers out of it, raise the memory limit{hint}."
        )
    # A baseline that breaks the limit is still shown (marked over it), in its fastest allowed mode.
    fastest = model.costs.fastest_modes(np.array(chosen[:-1]), np.array(chosen[1:]), units[:, 0], None, allowed,
                                        waits[:, 0])  # fmt: skip
    plan = _make_plan(model, req, chosen, method=method, modes=np.where(modes < 0, fastest, modes).tolist(), bound=None)
    if best is not None:
        opt = _make_plan(model, req, best.boundaries, method="autopipe", modes=best.modes, bound=best.lower_bound)
        plan = replace(plan, optimum_bottleneck_time=opt.bottleneck_time, optimum_step_time=opt.step_time,
                       step_lower_bound=best.lower_bound)  # fmt: skip
    return plan


def check_bounds(bounds: Sequence[int], n: int, k: int) -> tuple[int, ...]:
    for x in bounds:
        try:
            operator.index(x)  # ints and numpy ints; int() would truncate 1.5 to 1 without a word
        except TypeError:
            raise PartitionError(
                f"boundaries {list(bounds)} must be whole layer indices, but {x!r} is not; "
                f"give {k + 1} integers from 0 to {n}."
            ) from None
    b = tuple(operator.index(x) for x in bounds)
    if len(b) != k + 1 or b[0] != 0 or b[-1] != n:
        raise PartitionError(
            f"boundaries {list(b)} must be {k + 1} layer indices from 0 to {n} (one more than the chunks)."
        )
    for s, (x, y) in enumerate(zip(b, b[1:])):
        if x >= y:
            raise PartitionError(f"boundaries {list(b)}: chunk {s} ({x}..{y}) is empty; each needs a layer.")
    return b


def names_to_bounds(stage_names: Sequence[Sequence[str]], names: Sequence[str], k: int) -> tuple[int, ...]:
    """Boundaries from module/layer names per chunk; each chunk must be a contiguous run, in order."""
    if len(stage_names) != k:
        raise PartitionError(f"stage_names has {len(stage_names)} chunks, expected {k}.")
    owner = [-1] * len(names)
    for s, wanted in enumerate(stage_names):
        for w in wanted:
            hits = [i for i, name in enumerate(names) if name == w or name.startswith(w + ".")]
            if not hits:
                raise PartitionError(f"stage_names: {w!r} (chunk {s}) names no layer; layers are named like {names[0]!r}.")
            for i in hits:
                if owner[i] not in (-1, s):
                    raise PartitionError(f"stage_names: layer {names[i]!r} is in chunks {owner[i]} and {s}.")
                owner[i] = s
    empty = [s for s, wanted in enumerate(stage_names) if s not in owner]
    if empty:
        raise PartitionError(
            f"stage_names: chunk {empty[0]} is empty; give each of the {k} chunks at least one layer or module name."
        )
    missing = [names[i] for i, o in enumerate(owner) if o == -1]
    if missing:
        raise PartitionError(f"stage_names leaves {len(missing)} layers in no chunk, e.g. {missing[0]!r}.")
    if any(x > y for x, y in zip(owner, owner[1:])):
        i = next(i for i, (x, y) in enumerate(zip(owner, owner[1:])) if x > y)
        raise PartitionError(
            f"stage_names: chunks must be contiguous and in order, but {names[i]!r} (chunk {owner[i]}) "
            f"comes before {names[i + 1]!r} (chunk {owner[i + 1]})."
        )
    return check_bounds([0] + [owner.index(s) for s in range(1, k)] + [len(names)], len(names), k)


def _make_plan(model: CostModel, req: CutRequest, bounds: Sequence[int], *, method: str, modes: Sequence[int],
               bound: float | None) -> Plan:
    """The Plan of cut ``bounds`` with chunk recompute ``modes``: each chunk's seconds and bytes, the ranks'
    memory and the simulated step."""
    stages, v, m, schedule, states = req.stages, req.v, req.m, req.schedule, req.states
    c = model.costs
    a = np.asarray(bounds[:-1])
    b = np.asarray(bounds[1:])
    md = np.asarray(modes, dtype=np.int64)
    fwd = c.forward(a, b).tolist()
    bwd = c.backward(a, b, md).tolist()
    comm = c.comm(a, b).tolist()
    times = c.time(a, b, md).tolist()
    extra = c.extra_of(a, b, md).tolist()
    # each chunk in the state that is its peak for this cut and mode
    units, waits = state_arrays(states)
    per_state = c.memory(a, b, units[:, 0], md, waits[:, 0])  # (states, chunks)
    peak_at = per_state.argmax(axis=0)
    mems = [int(x) for x in per_state.max(axis=0)]
    inflight = [int(units[p, 0, s]) for s, p in enumerate(peak_at)]
    waiting = [int(waits[p, 0, s]) for s, p in enumerate(peak_at)]
    pairs = list(zip(bounds, bounds[1:]))
    ranks = chunk_ranks(schedule, stages, v)
    # The partitioner held each chunk at its own peak under the limit (their sum bounds the rank's).
    # The plan predicts each rank at its heaviest joint state instead, where several chunks share a
    # rank (interleaved, zbv): they do not peak together (schedules.rank_states). Until 2026-11-29
    # the CPU's resident peak read at least the sum, but that was glibc's heap holes among sub-MiB
    # activations; with them gone (devices.MMAP_THRESHOLD) the ranks held 0.84-0.92 of the sum.
    names = [c.modes[int(x)] for x in md]
    joint_in, joint_wait = charged_units(model.memory, bounds, schedule=schedule, stages=stages, virtual=v,
                                         microbatches=m, inflight=inflight, waiting=waiting, recompute=names)  # fmt: skip
    per_rank = rank_memory(model.memory, bounds, stage_ranks=ranks, inflight=joint_in, microbatches=m,
                           recompute=names, reserve=model.reserve, waiting=joint_wait, schedule=schedule)  # fmt: skip
    rank_mem = [r.total for r in per_rank]
    sim = simulate(schedule, forward=fwd, backward=bwd, comm=comm, ranks=stages, microbatches=m, weight_share=req.weight_share)
    # a CPU job's ranks beyond its cores share them: the step they run (the cut stays the dedicated optimum)
    cores = model.cores if 0 < model.cores < stages * model.dp else 0
    shared = (shared_step(schedule, forward=fwd, backward=bwd, comm=comm, ranks=stages, microbatches=m,
                          cores=cores / model.dp, weight_share=req.weight_share) if cores else None)  # fmt: skip
    slowest = int(np.argmax(times))
    return Plan(
        boundaries=tuple(int(x) for x in bounds),
        stages=stages,
        virtual_stages=v,
        microbatches=m,
        schedule=schedule,
        memory_limit=req.limit,
        memory_limit_source=req.limit_source,
        method=method,
        signature=req.signature,
        num_layers=c.n,
        bandwidth=model.bandwidth,
        stage_ranks=ranks,
        stage_times=tuple(times),
        stage_forward=tuple(fwd),
        stage_backward=tuple(bwd),
        stage_comm=tuple(comm),
        stage_memory=tuple(mems),
        stage_inflight=tuple(inflight),
        stage_waiting=tuple(waiting),
        rank_times=tuple(sum(times[s] for s in range(len(pairs)) if ranks[s] == r) for r in range(stages)),
        rank_memory=tuple(rank_mem),
        bottleneck_stage=slowest,
        bottleneck_time=times[slowest],
        peak_memory=max(rank_mem),
        step_time=sim.step_time,
        bubble_fraction=sim.bubble_fraction,
        stage_first_layers=tuple(model.names[x] for x, _ in pairs),
        weight_share=req.weight_share,
        optimizer=model.optimizer,
        stage_recompute=tuple(c.modes[int(x)] for x in md),
        stage_recompute_time=tuple(max(0.0, x) for x in extra),
        recompute=req.recompute,
        step_lower_bound=bound,
        target=req.target,
        allowed_cuts=req.cuts,
        rank_memory_breakdown=tuple(r.to_dict() for r in per_rank),
        dp=model.dp,
        zero=model.zero,  # what the job runs; with one replica it shards nothing (memory.zero_share)
        zero_policy=req.zero_policy,
        engine=model.engine.engine if model.engine is not None else "",
        step_overhead=model.after_schedule(bounds, ranks, stages),
        cores=cores,
        shared_step_time=shared,
    )
