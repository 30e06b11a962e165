"""The partition pass: Profile + stages + schedule + memory limit -> Plan.

This module turns a profile into per-chunk costs (autopipe/planner/cost_model.py over
autopipe/planner/chunk_costs.py), asks the step-time partitioner (autopipe/planner/step_solver.py, which
owns the algorithm) for the cut, applies user overrides and baselines, and fills the Plan; a limit
nothing fits is explained by autopipe/planner/refusals.py. The options travel as one checked record,
autopipe/planner/options.py's PartitionOptions: a re-plan with one option changed (one recompute
mode, no target, a baseline's method) is ``dataclasses.replace`` of it.

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
from dataclasses import fields, replace
from typing import Callable, Sequence

import numpy as np

from ..costs.engines import EngineCosts, engine_costs
from ..costs.layer_costs import Profile
from ..errors import AutopipeError, InfeasibleMemoryError, PartitionError
from ..units import format_bytes, parse_size
from .baselines import BASELINES, baseline
from .chunk_costs import state_arrays
from .cost_model import CostModel, CutRequest, unit_states
from .memory import RankMemory, charged_units, rank_memory
from .options import DEFAULT_BANDWIDTH, PartitionOptions, zero_choices
from .plan import Plan
from .refusals import chunk_need, explain_infeasible, fits_sentence, recompute_hint, with_zero_hint
from .schedules import check_weight_share, chunk_ranks, shared_step, simulate
from .step_bound import fits
from .step_solver import TIE, NoCutFits, StepSolution, solve_step
from .step_solver import steps_above as _steps_above
from .targets import check_cut_allowed, explain_restricted, restricted_cuts, target_info

__all__ = ["partition", "compare_baselines", "fits_memory", "resolve_limit", "zero_choices", "check_bounds",
           "names_to_bounds", "steps_above", "DEFAULT_BANDWIDTH", "PartitionOptions"]


def partition(
    profile: Profile,
    stages: int | None = None,
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
    options: PartitionOptions | None = None,
) -> Plan:
    """Cut a profiled layer sequence into pipeline stages so the schedule's step is as short as possible.

    The keyword options (``microbatches``, ``schedule``, ``memory_limit``, ``optimizer``,
    ``virtual_stages``, ``bandwidth``, ``boundaries``, ``stage_names``, ``method``, ``weight_share``,
    ``recompute``, ``dp``, ``zero``, ``cuts``, ``target``, ``engine``) are each a field of
    :class:`~autopipe.planner.options.PartitionOptions`, documented there, with the same defaults
    (the schedule 1f1b, the device's memory, 25 GB/s, recompute auto, ...).

    Args:
        profile: per-layer costs (``autopipe.profile`` or ``Profile.from_costs``).
        stages: pipeline ranks S.
        options: the same as one record, instead of ``stages`` and the keywords (not beside them).

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
        >>> partition(prof, options=PartitionOptions(3, bandwidth=None)) == plan
        True
    """
    keywords: dict[str, object] = {"microbatches": microbatches, "schedule": schedule, "memory_limit": memory_limit,
                                   "optimizer": optimizer, "virtual_stages": virtual_stages, "bandwidth": bandwidth,
                                   "boundaries": boundaries, "stage_names": stage_names, "method": method,
                                   "weight_share": weight_share, "recompute": recompute, "dp": dp, "zero": zero,
                                   "cuts": cuts, "target": target, "engine": engine}  # fmt: skip
    return _partition(profile, _options(stages, keywords, options))


def _options(stages: int | None, keywords: dict[str, object], options: PartitionOptions | None) -> PartitionOptions:
    """The one record a call gives: built from ``stages`` and the keywords, or ``options`` as it is.

    Both at once is refused, not merged: which should win would be a guess, and a keyword at its
    default cannot be told from one not given."""
    if options is None:
        if stages is None:
            raise PartitionError("partition needs stages: partition(profile, stages, ...) or "
                                 "partition(profile, options=PartitionOptions(stages, ...)).")
        return PartitionOptions(stages, **keywords)  # type: ignore[arg-type]
    if not isinstance(options, PartitionOptions):
        raise PartitionError(f"options={type(options).__name__}: give a PartitionOptions record "
                             "(autopipe.planner.PartitionOptions).")
    defaults = {f.name: f.default for f in fields(PartitionOptions)}
    given = ([f"stages={stages!r}"] if stages is not None else []) + [
        f"{name}={value!r}" for name, value in keywords.items() if _differs(value, defaults[name])]
    if given:
        raise PartitionError(f"partition takes options=PartitionOptions(...) or keywords, not both ({', '.join(given)} "
                             f"beside options); use options=dataclasses.replace(options, {given[0]}).")
    return options


def _differs(value: object, default: object) -> bool:
    """Whether a keyword was moved off its default (a list or array given is never compared: only
    a default of None has them, and ``is not None`` says it)."""
    return value is not None if default is None else (value is None or value != default)


def _partition(profile: Profile, opts: PartitionOptions) -> Plan:
    """``partition`` for one checked record; every re-plan inside the planner comes back here with
    ``dataclasses.replace(opts, ...)``, so no option is passed along by hand."""
    if not profile.layers:
        raise PartitionError("the profile has no layers.")
    if opts.target is not None and opts.recompute == "auto" and not target_info(opts.target).per_stage_recompute:
        return _for_one_mode_engine(profile, opts)
    req = _request(profile, opts)
    costs, bandwidth = _engine_and_link(profile, opts)

    def attempt(z: int) -> Plan:
        model = CostModel(profile, opts.optimizer, bandwidth, req.schedule, req.m, dp=opts.dp, zero=z, engine=costs)
        return _partition_one(profile, model, req, opts)

    return _fastest_zero(attempt, opts, req.limit)


def _request(profile: Profile, opts: PartitionOptions) -> CutRequest:
    """What every ZeRO stage's attempt shares, with what the options leave to the profile filled in:
    its weight share, its device's memory for "device", the cuts its layer names allow."""
    weight_share = opts.weight_share
    if weight_share is None:
        split = profile.split_backward
        weight_share = split[0] if split is not None else 0.5
        check_weight_share(weight_share)
    n, k = len(profile.layers), opts.stages * opts.v
    if k > n:
        raise PartitionError(
            f"cannot cut {n} layers into {k} non-empty chunks ({opts.stages} stages x {opts.v} virtual); "
            f"use at most {n // opts.v} stages."
        )
    limit, limit_source = resolve_limit(profile, opts.memory_limit)
    allowed = restricted_cuts(profile, k, opts.cuts, opts.target)
    return CutRequest(stages=opts.stages, v=opts.v, m=opts.m, schedule=opts.schedule, limit=limit,
                      limit_source=limit_source, recompute=opts.recompute, weight_share=weight_share,
                      states=unit_states(opts.schedule, opts.stages, opts.v, opts.m), signature=profile.signature,
                      zero_policy=str(opts.zero), cuts=None if allowed is None else allowed.cuts,
                      target=target_info(opts.target).key if opts.target else "")  # fmt: skip


def _engine_and_link(profile: Profile, opts: PartitionOptions) -> tuple[EngineCosts | None, float | None]:
    """The engine's measured costs on this profile's host (None: the layers alone), and the link to price
    sends at: the engine's measured one where the default 25 GB/s (a GPU's PCIe guess) was left."""
    engine = opts.engine
    costs = engine if isinstance(engine, EngineCosts) else engine_costs(engine, profile.device.type)
    if costs is not None:
        costs = costs.on_host(profile.device.host_probe)  # the table's runtime seconds, on this profile's host
    bandwidth = opts.bandwidth
    if costs is not None and costs.bandwidth is not None and bandwidth == DEFAULT_BANDWIDTH:
        bandwidth = costs.bandwidth
    return costs, bandwidth


def _fastest_zero(attempt: Callable[[int], Plan], opts: PartitionOptions, limit: int | None) -> Plan:
    """The plan of each ZeRO stage to try (one unless zero="auto"), and the one kept: the fastest that
    fits, the lowest stage on a tie (the least to gather); for a cut the user or a baseline fixed, the
    lowest stage under which it fits, else the most sharded."""
    zeros = opts.zero_stages
    plans: list[Plan] = []
    failure: InfeasibleMemoryError | None = None
    for z in zeros:
        try:
            plans.append(attempt(z))
        except InfeasibleMemoryError as e:
            failure = e
    if not plans:
        assert failure is not None
        raise with_zero_hint(failure, attempt, zeros, opts.dp)
    if len(plans) == 1:
        return plans[0]
    fitting = [p for p in plans if limit is None or p.peak_memory <= limit]
    if opts.method == "autopipe" and opts.boundaries is None and opts.stage_names is None:
        best = min(p.step_time for p in fitting or plans)
        return next(p for p in fitting or plans if p.step_time <= best * (1 + TIE))
    return fitting[0] if fitting else plans[-1]


def _for_one_mode_engine(profile: Profile, opts: PartitionOptions) -> Plan:
    """The plan for a target engine that applies one recompute mode to every stage: the fastest single
    mode that fits, set against autopipe's own plan (any cut, each chunk its own mode), which says
    what planning for the engine costs (``unrestricted_step_time``)."""
    plan = _one_mode(profile, opts, target_info(opts.target).recompute)
    if plan.method != "autopipe" or opts.cuts is not None:
        return plan
    try:
        free = _partition(profile, replace(opts, target=None))
    except InfeasibleMemoryError:
        return plan
    return replace(plan, unrestricted_step_time=free.step_time, unrestricted_boundaries=free.boundaries)


def _one_mode(profile: Profile, opts: PartitionOptions, modes: Sequence[str]) -> Plan:
    """The plan of the recompute mode (one for every chunk) whose step is the least; the first on a tie
    (modes go none, selective, full). A mode the profile has no figures for is passed over. Raises the
    last refusal when no mode fits (a bad option fails in every mode alike)."""
    best: Plan | None = None
    failure: PartitionError | None = None
    for mode in modes:
        try:
            plan = _partition(profile, replace(opts, recompute=mode))
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
    """The baselines' plans for the same profile, stages, schedule, micro-batches, bandwidth, optimizer and engine
    (``PartitionOptions.of_plan``).

    A baseline that cannot be made (e.g. fewer layers than it needs) is left out; one that breaks the
    memory limit is kept (the report marks it), because that is exactly what the comparison shows.
    """
    try:
        same = PartitionOptions.of_plan(plan)
    except AutopipeError:  # a plan whose options no longer stand: no baseline can be made under them
        return {}
    out: dict[str, Plan] = {}
    for method in BASELINES:
        try:
            out[method] = _partition(profile, replace(same, method=method))
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


def _model_for_bounds(profile: Profile, opts: PartitionOptions) -> tuple[CostModel, CutRequest] | None:
    """The cost model and request ``partition`` solves for autopipe's own cut at one ZeRO stage, or None
    where it solves something else (a fixed cut, a baseline, several ZeRO stages, a one-mode engine)
    or refuses the limit outright."""
    if (opts.method != "autopipe" or opts.boundaries is not None or opts.stage_names is not None
            or len(opts.zero_stages) != 1 or (opts.target is not None and opts.recompute == "auto"
                                              and not target_info(opts.target).per_stage_recompute)):  # fmt: skip
        return None
    req = _request(profile, opts)
    engine, bandwidth = _engine_and_link(profile, opts)
    model = CostModel(profile, opts.optimizer, bandwidth, req.schedule, req.m, dp=opts.dp, zero=opts.zero_stages[0],
                      engine=engine)  # fmt: skip
    if req.limit is not None and model.budget(req.limit, req.stages) // req.v <= 0:
        return None  # partition explains this one
    return model, req


def steps_above(profile: Profile, options: PartitionOptions, step: float, after: Sequence[float] | None = None) -> bool:
    """Whether every cut ``partition(profile, options=options)`` could return steps longer than ``step``
    (simulated pipeline step, seconds), proven by the solver's bound at ``step`` without solving
    (step_solver.steps_above: one chunk per rank, one ZeRO stage, autopipe's own cut); False where
    that is not proven (virtual stages, a fixed cut or a baseline, ZeRO "auto", a one-mode engine).
    ``after``: seconds per layer rank 0 adds after its last op (step_solver.steps_above)."""
    model_req = _model_for_bounds(profile, options) if options.v == 1 else None
    if model_req is None:
        return False
    model, req = model_req
    return _steps_above(model.costs, req.schedule, step, ranks=req.stages, microbatches=req.m, states=req.states,
                        limit=_chunk_limit(model, req), modes=model.allowed(req.recompute), cuts=req.cuts,
                        after=after)  # fmt: skip


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


def _partition_one(profile: Profile, model: CostModel, req: CutRequest, opts: PartitionOptions) -> Plan:
    """The plan for one ZeRO stage (the model's): the optimum, or the cut given (or a baseline's) with
    the optimum's figures beside it. The optimum is solved for the cut given too, so a plan says how far
    from the best it is; where nothing fits, that is an error only when no cut was given."""
    chunk_limit = _chunk_limit(model, req)
    allowed = model.allowed(req.recompute)
    chosen, method = _fixed_cut(profile, model, req, opts)
    best: StepSolution | None = None
    try:
        best = _solve(model, req, chunk_limit, allowed, req.cuts)
    except NoCutFits:
        if chosen is None:
            raise _no_cut_fits(profile, model, req, chunk_limit) from None
    if chosen is None:
        assert best is not None
        plan = _make_plan(model, req, best.boundaries, method="autopipe", modes=best.modes, bound=best.lower_bound)
        if req.cuts is not None:  # what the restriction costs: the best cut the engine cannot make
            free = _solve(model, req, chunk_limit, allowed, None)
            plan = replace(plan, unrestricted_step_time=free.step, unrestricted_boundaries=free.boundaries)
        return plan
    plan = _plan_of_cut(model, req, chosen, method, chunk_limit, allowed)
    if best is not None:
        opt = _make_plan(model, req, best.boundaries, method="autopipe", modes=best.modes, bound=best.lower_bound)
        plan = replace(plan, optimum_bottleneck_time=opt.bottleneck_time, optimum_step_time=opt.step_time,
                       step_lower_bound=best.lower_bound)  # fmt: skip
    return plan


def _chunk_limit(model: CostModel, req: CutRequest) -> int | None:
    """Bytes each chunk may hold (None: unlimited): the runtime's own fixed terms first (reserve; on a
    GPU context, workspaces, NCCL, the allocator's slack), then each of a rank's v chunks a share of the rest."""
    limit = req.limit
    if limit is None:
        return None
    chunk_limit = model.budget(limit, req.stages) // req.v
    if chunk_limit <= 0:
        fixed = limit - model.budget(limit, req.stages)
        what = ("what a CPU rank was measured holding beyond its tensors here, above the profile's reserve"
                if model.limit_reserve > model.reserve else
                "the profile's reserve, and on a GPU its context, workspaces and NCCL buffers")
        raise InfeasibleMemoryError(
            f"a memory limit of {format_bytes(limit)} per device leaves nothing for the model: the runtime itself "
            f"holds {format_bytes(fixed)} per rank on this device ({what}); {fits_sentence(model, req)}. "
            "Raise the limit."
        )
    return chunk_limit


def _fixed_cut(profile: Profile, model: CostModel, req: CutRequest,
               opts: PartitionOptions) -> tuple[tuple[int, ...] | None, str]:  # fmt: skip
    """The cut the options fix and the method to record: the user's (``manual``), a baseline's, or
    (None, "autopipe") for the search. A fixed cut must keep to the cuts the target allows."""
    chosen: tuple[int, ...] | None = None
    method = opts.method
    n, k = len(profile.layers), req.stages * req.v
    if opts.boundaries is not None or opts.stage_names is not None:
        chosen = (check_bounds(opts.boundaries, n, k) if opts.boundaries is not None
                  else names_to_bounds(opts.stage_names, model.names, k))  # type: ignore[arg-type]  # fmt: skip
        method = "manual"
    elif method != "autopipe":
        chosen = baseline(method, k, times=profile.times, params=model.params, names=model.names)
    if chosen is not None and req.cuts is not None:
        check_cut_allowed(chosen, req.cuts, model.names, req.target, method)
    return chosen, method


def _solve(model: CostModel, req: CutRequest, chunk_limit: int | None, allowed: Sequence[int],
           cuts: tuple[int, ...] | None) -> StepSolution:  # fmt: skip
    """The step solver on this request's shape (step_solver.solve_step), over ``cuts`` (None: any)."""
    return solve_step(model.costs, req.schedule, ranks=req.stages, virtual=req.v, microbatches=req.m, states=req.states,
                      limit=chunk_limit, modes=allowed, weight_share=req.weight_share, cuts=cuts)  # fmt: skip


def _no_cut_fits(profile: Profile, model: CostModel, req: CutRequest, chunk_limit: int | None) -> InfeasibleMemoryError:
    """Why no cut fits and what would (refusals.explain_infeasible), naming where the limit came from."""
    limit = req.limit
    assert limit is not None  # with no limit every cut fits
    what = (f"the {profile.device.name}'s {format_bytes(limit)} (its memory, the default limit)"
            if req.limit_source == "device" else f"{format_bytes(limit)} per device")  # fmt: skip
    if req.cuts is not None:
        return explain_restricted(explain_infeasible(model, req, chunk_limit, what), req.target)
    return explain_infeasible(model, req, chunk_limit, what)


def _plan_of_cut(model: CostModel, req: CutRequest, chosen: tuple[int, ...], method: str, chunk_limit: int | None,
                 allowed: Sequence[int]) -> Plan:  # fmt: skip
    """The plan of a fixed cut, each chunk in its fastest mode that fits. A manual chunk that fits in no
    mode is refused (the user can move layers); a baseline's is kept in its fastest mode, over the
    limit (the report marks it), because that is what the comparison shows."""
    states = req.states
    units, waits = state_arrays(states)
    a, b = np.array(chosen[:-1]), np.array(chosen[1:])
    modes = model.costs.fastest_modes(a, b, units[:, 0], chunk_limit, allowed, waits[:, 0])
    if method == "manual" and chunk_limit is not None and np.any(modes < 0):
        c = int(np.flatnonzero(modes < 0)[0])
        lo, hi = chosen[c], chosen[c + 1]
        need = min(chunk_need(model.costs, lo, hi, states[c], md) for md in allowed)
        hint = recompute_hint(model, req.recompute, [(lo, hi, states[c])], chunk_limit)
        raise InfeasibleMemoryError(
            f"your chunk {c} (layers {lo}..{hi - 1}) needs {format_bytes(need)}, more than the "
            f"{format_bytes(chunk_limit)} it may use; move layers out of it, raise the memory limit{hint}."
        )
    fastest = model.costs.fastest_modes(a, b, units[:, 0], None, allowed, waits[:, 0])
    return _make_plan(model, req, chosen, method=method, modes=np.where(modes < 0, fastest, modes).tolist(), bound=None)


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
    stages, v, m, schedule = req.stages, req.v, req.m, req.schedule
    c = model.costs
    a = np.asarray(bounds[:-1])
    b = np.asarray(bounds[1:])
    md = np.asarray(modes, dtype=np.int64)
    fwd = c.forward(a, b).tolist()
    bwd = c.backward(a, b, md).tolist()
    comm = c.comm(a, b).tolist()
    times = c.time(a, b, md).tolist()
    extra = c.extra_of(a, b, md).tolist()
    mems, inflight, waiting = _chunk_peaks(model, req, a, b, md)
    pairs = list(zip(bounds, bounds[1:]))
    ranks = chunk_ranks(schedule, stages, v)
    per_rank = _rank_peaks(model, req, bounds, ranks, inflight, waiting, [c.modes[int(x)] for x in md])
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
        profile_noise=model.noise,
    )


def _chunk_peaks(model: CostModel, req: CutRequest, a: np.ndarray, b: np.ndarray,
                 md: np.ndarray) -> tuple[list[int], list[int], list[int]]:  # fmt: skip
    """Each chunk in the state that is its peak for this cut and mode: its bytes, the micro-batches it
    then holds in flight, and those waiting for their weight pass (zbv)."""
    units, waits = state_arrays(req.states)
    per_state = model.costs.memory(a, b, units[:, 0], md, waits[:, 0])  # (states, chunks)
    peak_at = per_state.argmax(axis=0)
    mems = [int(x) for x in per_state.max(axis=0)]
    inflight = [int(units[p, 0, s]) for s, p in enumerate(peak_at)]
    waiting = [int(waits[p, 0, s]) for s, p in enumerate(peak_at)]
    return mems, inflight, waiting


def _rank_peaks(model: CostModel, req: CutRequest, bounds: Sequence[int], ranks: Sequence[int], inflight: list[int],
                waiting: list[int], names: list[str]) -> list[RankMemory]:  # fmt: skip
    """What each rank holds at its heaviest joint state (memory.rank_memory, term by term).

    The partitioner held each chunk at its own peak under the limit (their sum bounds the rank's).
    The plan predicts each rank at its heaviest joint state instead, where several chunks share a
    rank (interleaved, zbv): they do not peak together (schedules.rank_states). Until 2026-11-29
    the CPU's resident peak read at least the sum, but that was glibc's heap holes among sub-MiB
    activations; with them gone (devices.MMAP_THRESHOLD) the ranks held 0.84-0.92 of the sum."""
    stages, v, m, schedule = req.stages, req.v, req.m, req.schedule
    joint_in, joint_wait = charged_units(model.memory, bounds, schedule=schedule, stages=stages, virtual=v,
                                         microbatches=m, inflight=inflight, waiting=waiting, recompute=names)  # fmt: skip
    return rank_memory(model.memory, bounds, stage_ranks=ranks, inflight=joint_in, microbatches=m,
                       recompute=names, reserve=model.reserve, waiting=joint_wait, schedule=schedule)  # fmt: skip
