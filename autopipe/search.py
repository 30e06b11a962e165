"""Plan a cluster: the layout of N devices with the highest predicted throughput. No torch.

A layout is pipeline stages S × data-parallel replicas R (S·R = N), a micro-batch size b and count M
(b·M·R = the global batch), a schedule with its virtual stages v, a ZeRO stage and a placement of
the ranks on the nodes (autopipe/topology.py). Recompute is not enumerated: ``partition`` with
``recompute="auto"`` already gives each chunk the fastest mode that fits, which is optimal per cut.

Objective. Throughput = global batch / step, where the step of a layout is its schedule's simulated
step (``partition``'s exact step-time cut, p2p over the placement's pipeline link) plus the
data-parallel reduction: rank r starts reducing its gradients when its last op ends and the step ends
when the last rank is done, ``step = max_r(end_r + reduce_r)`` (topology.dp_reduce_time over the
replicas' link). So a stage that finishes its backward early (the last stage under 1F1B) reduces
while the first stages drain the pipeline: the reduction overlaps the cooldown, never a rank's own
compute. Other micro-batch sizes come from the profile by mbscale.scale_microbatch.

Method: branch and bound over the enumerated layouts.

1. Memory bound. Over all S·v chunks a layout holds at least the whole model's weights, gradients
   and optimizer state as sharded under (R, ZeRO) plus, in every chunk, the fewest in-flight
   micro-batches of its least-keeping recompute mode; each chunk may use (limit − reserve) / v. A
   layout whose total exceeds S·v chunk limits cannot fit: pruned without solving.
2. Step bound. A rank's ops form a chain, so ``step >= M·(its work)``; with one chunk per rank its
   first forward waits for micro-batch 0 through the stages before it and its last backward's
   gradient goes back through them, ``step >= M·t_s + Σ_{j<s} t_j`` for every stage s. Averaging
   those S bounds with weights that give every layer the same coefficient gives
   ``step >= c·Σt`` with ``c = 1 / (1 − (1 − 1/M)^S)`` (M/S ≤ c ≤ (M + S − 1)/S; equal stages reach
   (M + S − 1)·Σt/S); each rank's reduction follows its last op, and the smallest weight is
   (c − 1)/(M − 1), so ``+ (c − 1)/(M − 1)·Σ_r reduce_r``. Every schedule: ``step >= (M·Σt +
   Σ_r reduce_r)/S``, the mean of the ranks' chains plus their reductions. Send/recv and recompute
   only add, so both hold for every cut; Σ_r reduce_r is at least the reduction of the whole model.
3. Solve in order of the bound's throughput, best first; stop when the next layout's bound cannot
   beat the ``top``-th best solved (ties are solved, not pruned). The bounds only ever overstate
   throughput, so the best ``top`` layouts are exactly those of solving every layout.

Complexity: enumeration O(d(N)·d(B)·schedules·ZeRO·2); each bound O(L); each solve one
``partition`` call (see stepsolve.py) plus one simulation. Counts of considered, pruned and solved
layouts are in the result.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from .errors import InfeasibleMemoryError
from .layouts import SEARCH_SCHEDULES, Layout, SearchResult, enumerate_layouts
from .mbscale import profiled_microbatch, scale_microbatch, tokens_per_sample
from .memory import ZERO_STAGES, layer_memory
from .partition import fits_memory, partition, resolve_limit
from .plan import Plan
from .records import Profile
from .schedule import chunk_ranks, inflight_counts
from .topology import Cluster, place

__all__ = ["Layout", "SearchResult", "SEARCH_SCHEDULES", "search", "evaluate", "enumerate_layouts", "step_bound"]

class _Bounds:
    """The cheap bounds of the module docstring for one profile (at its own micro-batch size)."""

    def __init__(self, profile: Profile, optimizer: str | None, limit: int | None, cluster: Cluster) -> None:
        self.profile, self.optimizer, self.limit, self.cluster = profile, optimizer, limit, cluster
        self.work = sum(profile.times)
        base = layer_memory(profile, optimizer)
        # a tied tensor's repeats may all sit on one rank: leave them out of what must be reduced
        self.grads = sum(base.gradients) - sum((len(u) - 1) * tg for _s, u, _w, tg, *_ in base.tied)
        self.weights = sum(base.weights) - sum((len(u) - 1) * tw for _s, u, tw, *_ in base.tied)
        self._static: dict[tuple[int, int], tuple[int, int]] = {}

    def _memory(self, dp: int, zero: int) -> tuple[int, int]:
        """(static bytes of the whole model, least activation bytes per micro-batch) under (dp, zero)."""
        if (dp, zero) not in self._static:
            # DDP's terms (the default schedule's): no more than replicate's, so still a lower bound under zbv
            lm = layer_memory(self.profile, self.optimizer, dp=dp, zero=zero)
            static = sum(lm.static) - sum((len(u) - 1) * size for size, u, *_ in lm.tied)
            acts = sum(min(col) for col in zip(*lm.activations.values()))
            self._static[(dp, zero)] = (static, acts)
        return self._static[(dp, zero)]

    def fits(self, x: Layout, scale: float) -> bool:
        if self.limit is None:
            return True
        static, acts = self._memory(x.dp, x.zero)
        least = min(inflight_counts(x.schedule, x.stages, x.virtual_stages, x.microbatches))
        chunk = (self.limit - self.profile.reserve_bytes) // x.virtual_stages
        return chunk > 0 and static + least * acts * scale <= x.stages * x.virtual_stages * chunk

    def throughput(self, x: Layout, scale: float) -> float:
        return x.global_batch / step_bound(x, self.work * scale, self.grads, self.weights, self.cluster)


def step_bound(x: Layout, work: float, grads: float, weights: float, cluster: Cluster) -> float:
    """A lower bound on the step of every cut of layout ``x`` (module docstring, step 2): ``work`` is
    one micro-batch's forward + backward seconds through the whole model."""
    from .topology import dp_reduce_time

    bw = place(cluster, stages=x.stages, dp=x.dp, order=x.placement).dp_bandwidth
    m, s = x.microbatches, x.stages
    reduce = dp_reduce_time(grads, weights, x.dp, bw, x.zero)
    chains = (m * work + reduce) / s
    if x.virtual_stages > 1:
        return chains
    c = 1.0 / (1.0 - (1.0 - 1.0 / m) ** s)
    # the weights' smallest, (c - 1)/(M - 1) on stage 0, times every rank's reduction after its last op
    return max(chains, c * work + (0.0 if m == 1 else (c - 1.0) / (m - 1) * reduce))


def evaluate(profile: Profile, cluster: Cluster, x: Layout, *, memory_limit: int | str | None = "device",
             optimizer: str | None = None, recompute: str = "auto", method: str = "autopipe",
             boundaries: Sequence[int] | None = None, weight_share: float | None = None,
             cache: dict | None = None) -> tuple[Layout, Plan | None]:  # fmt: skip
    """Solve layout ``x`` (or price a given cut / baseline method on it): the Layout with its
    predictions filled in, and its Plan. Raises InfeasibleMemoryError when no cut fits.

    With a ``cache`` (a dict the caller keeps across layouts) the cut is first solved without a
    memory limit, once for every ZeRO stage and replica count that share the schedule, micro-batches
    and link (the limit is the only thing they change in ``partition``); when that cut fits this
    layout's memory, chunk by chunk as partition requires, it is this layout's optimum too and no
    further solve is needed. The Plan is then None (``partition`` gives it again when wanted).
    """
    from .topology import dp_reduce_time

    prof = scale_microbatch(profile, x.microbatch_size)
    p = place(cluster, stages=x.stages, dp=x.dp, order=x.placement)
    bw = None if x.stages == 1 else p.p2p_bandwidth
    opts = dict(microbatches=x.microbatches, schedule=x.schedule, virtual_stages=x.virtual_stages, optimizer=optimizer,
                recompute=recompute, bandwidth=bw, weight_share=weight_share)  # fmt: skip
    plan: Plan | None = None
    limit, _ = resolve_limit(profile, memory_limit)
    plain = "none" if recompute == "auto" else recompute  # what the unlimited cut's chunks run
    if cache is not None and limit is not None and not fits_memory(
            prof, x.stages, microbatches=x.microbatches, schedule=x.schedule, virtual_stages=x.virtual_stages,
            memory_limit=limit, optimizer=optimizer, recompute=plain, dp=x.dp, zero=x.zero):  # fmt: skip
        cache = None  # no cut fits without recompute, so the unlimited cut cannot either: solve with the limit
    source: Plan | None = None  # the plan whose cut and seconds this layout takes
    peak: int | None = None
    if cache is not None and method == "autopipe" and boundaries is None:
        key = (x.stages, x.microbatch_size, x.microbatches, x.schedule, x.virtual_stages, bw)
        if key not in cache:
            cache[key] = partition(prof, x.stages, memory_limit=None, **opts)  # type: ignore[arg-type]
        peak = _peak_if_fits(prof, cache[key], x, optimizer, limit)
        source = cache[key] if peak is not None else None
    if source is None:
        plan = source = partition(prof, x.stages, memory_limit=memory_limit, dp=x.dp, zero=x.zero, method=method,
                                  boundaries=boundaries, **opts)  # type: ignore[arg-type]
        peak = plan.peak_memory
    assert peak is not None
    sim, cut, modes, rec = source.simulate(), source.boundaries, source.stage_recompute, source.stage_recompute_time
    fwd, bwd, comm = source.stage_forward, source.stage_backward, source.stage_comm
    ranks = sim.timeline
    owners = chunk_ranks(x.schedule, x.stages, x.virtual_stages)
    lm = layer_memory(prof, optimizer)
    step = reduce_max = 0.0
    for r, ops in enumerate(ranks):
        held = sorted({i for c, owner in enumerate(owners) if owner == r for i in range(cut[c], cut[c + 1])})
        g, w = sum(lm.gradients[i] for i in held), sum(lm.weights[i] for i in held)
        for _size, users, tw, tg, *_ in lm.tied:  # a tied tensor is reduced once per rank
            extra = max(sum(1 for i in held if i in users) - 1, 0)
            g, w = g - extra * tg, w - extra * tw
        red = dp_reduce_time(g, w, x.dp, p.dp_bandwidth, x.zero)
        reduce_max = max(reduce_max, red)
        step = max(step, (ops[-1][1] if ops else 0.0) + red)
    m, s, k = x.microbatches, x.stages, len(cut) - 1
    tokens = tokens_per_sample(profile)
    done = replace(
        x, step_time=step, pipeline_time=sim.step_time, reduce_time=reduce_max, throughput=x.global_batch / step,
        tokens_per_second=None if tokens is None else x.global_batch * tokens / step, peak_memory=int(peak),
        fits=limit is None or peak <= limit, recompute=tuple(modes), boundaries=tuple(cut),
        ideal_time=m * sum(fwd[c] + bwd[c] - rec[c] for c in range(k)) / s, recompute_time=m * sum(rec) / s,
        p2p_time=m * 2 * sum(comm) / s,
    )  # fmt: skip
    return done, plan


def _peak_if_fits(prof: Profile, free: Plan, x: Layout, optimizer: str | None, limit: int | None) -> int | None:
    """The rank peak of the unconstrained cut ``free`` under x's replicas and ZeRO stage, if each of its
    chunks fits (limit − reserve) / v as partition requires; else None."""
    from .memory import rank_memory

    lm = layer_memory(prof, optimizer, dp=x.dp, zero=x.zero, schedule=x.schedule)
    common = dict(inflight=free.stage_inflight, microbatches=free.microbatches, recompute=free.stage_recompute,
                  reserve=prof.reserve_bytes, waiting=free.stage_waiting, schedule=x.schedule)  # fmt: skip
    ranks = rank_memory(lm, free.boundaries, stage_ranks=free.stage_ranks, **common)  # type: ignore[arg-type]
    peak = max(r.total for r in ranks)
    if limit is None:
        return peak
    if x.virtual_stages == 1:
        return peak if peak <= limit else None
    chunks = rank_memory(lm, free.boundaries, stage_ranks=tuple(range(free.num_chunks)), **common)  # type: ignore[arg-type]
    share = (limit - prof.reserve_bytes) // x.virtual_stages
    return peak if all(c.total - prof.reserve_bytes <= share for c in chunks) else None


def _rank(x: Layout) -> tuple:
    """Best first: throughput, then the smaller peak, then the simpler layout (fewer stages, lower ZeRO)."""
    return (-(x.throughput or 0.0), x.peak_memory or 0, x.stages, x.zero, x.virtual_stages, x.key())


def search(profile: Profile, cluster: Cluster, *, global_batch: int, memory_limit: int | str | None = "device",
           optimizer: str | None = None, recompute: str = "auto", zeros: Sequence[int] = ZERO_STAGES,
           schedules: Sequence[tuple[str, int]] = SEARCH_SCHEDULES, microbatch_sizes: Sequence[int] | None = None,
           top: int = 3, prune: bool = True, weight_share: float | None = None) -> SearchResult:  # fmt: skip
    """The layouts of ``cluster`` for ``global_batch`` samples per step, best predicted throughput first.

    ``prune=False`` solves every layout (what the tests compare the pruned search with). Raises
    InfeasibleMemoryError, with what would fit in one line (autopipe.search_hint), when none fits.

    Example:
        >>> from autopipe.topology import cluster_for
        >>> prof = Profile.from_costs([1.0] * 8, param_bytes=[100] * 8, activation_bytes=[10] * 8)
        >>> res = search(prof, cluster_for("cpu", 4, 4), global_batch=8, memory_limit=None)
        >>> res.best.stages * res.best.dp, res.considered >= res.solved
        (4, True)
    """
    clock = time.perf_counter()
    limit, _ = resolve_limit(profile, memory_limit)
    profile_mb = profiled_microbatch(profile)
    bounds = _Bounds(profile, optimizer, limit, cluster)
    todo, considered, pruned_memory, dominated = [], 0, 0, 0
    for x in enumerate_layouts(len(profile.layers), cluster, global_batch, schedules=schedules, zeros=zeros,
                               microbatch_sizes=microbatch_sizes):  # fmt: skip
        considered += 1
        # ZeRO 3 holds what 2 holds under a pipeline (autopipe.memory), so partition gives it the same
        # cut, and it gathers the weights twice: never faster. (ZeRO 0 against 1 is no such case: a
        # different limit can give a cut of the same pipeline step whose ranks reduce at other times.)
        if prune and x.dp > 1 and x.zero == 3 and 2 in zeros:
            dominated += 1
            continue
        scale = x.microbatch_size / profile_mb
        if prune and not bounds.fits(x, scale):
            pruned_memory += 1
            continue
        todo.append(replace(x, bound=bounds.throughput(x, scale)))
    todo.sort(key=lambda x: (-x.bound, x.key()))
    found: list[Layout] = []
    cache: dict = {}
    solved = infeasible = pruned_bound = 0
    for i, x in enumerate(todo):
        if prune and len(found) >= top:
            kth = sorted(found, key=_rank)[top - 1].throughput or 0.0
            if x.bound < kth * (1 - 1e-12):  # sorted by bound: none after it can beat the top ones either
                pruned_bound = len(todo) - i
                break
        solved += 1
        if limit is not None and not fits_memory(
                scale_microbatch(profile, x.microbatch_size), x.stages, microbatches=x.microbatches,
                schedule=x.schedule, virtual_stages=x.virtual_stages, memory_limit=limit, optimizer=optimizer,
                recompute=recompute, dp=x.dp, zero=x.zero):  # fmt: skip
            infeasible += 1  # no cut fits: known from one reachability, no solve (or explanation) needed
            continue
        try:
            done, _ = evaluate(profile, cluster, x, memory_limit=limit, optimizer=optimizer, recompute=recompute,
                               weight_share=weight_share, cache=cache)  # fmt: skip
        except InfeasibleMemoryError:
            infeasible += 1
            continue
        found.append(done)
    found.sort(key=_rank)
    if not found:
        from .search_hint import why_nothing_fits

        raise InfeasibleMemoryError(why_nothing_fits(profile, cluster, global_batch=global_batch, limit=limit,
                                                     optimizer=optimizer, recompute=recompute, zeros=zeros))  # fmt: skip
    # the best layout's Plan, with its own limit, replicas and ZeRO stage (the job's plan.json)
    best, plan = evaluate(profile, cluster, found[0], memory_limit=limit, optimizer=optimizer, recompute=recompute,
                          weight_share=weight_share)  # fmt: skip
    if (best.step_time or 0.0) > (found[0].step_time or 0.0) * (1 + 1e-9):
        # the unconstrained cut beat the limited search's (a heuristic schedule): keep that cut
        best, plan = evaluate(profile, cluster, found[0], memory_limit=limit, optimizer=optimizer,
                              recompute=recompute, weight_share=weight_share, method="manual",
                              boundaries=found[0].boundaries)  # fmt: skip
        plan = replace(plan, method="autopipe") if plan is not None else plan
    found[0] = replace(best, bound=found[0].bound)  # the plan's own figures (its cut may tie at a lower peak)
    return SearchResult(
        layouts=tuple(found), gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node, bandwidth_intra=cluster.intra,
        bandwidth_inter=cluster.inter, global_batch=global_batch, memory_limit=limit, considered=considered,
        pruned_memory=pruned_memory, pruned_bound=pruned_bound, pruned_dominated=dominated, solved=solved, infeasible=infeasible,
        seconds=time.perf_counter() - clock, top=top, plan=plan,
    )  # fmt: skip
