"""Plan a cluster: the layout of N devices with the highest predicted throughput. No torch.

A layout is pipeline stages S × data-parallel replicas R (S·R = N), a micro-batch size b and count M
(b·M·R = the global batch), a schedule with its virtual stages v, a ZeRO stage and a placement of
the ranks on the nodes (autopipe/cluster/topology.py). Recompute is not enumerated: ``partition`` with
``recompute="auto"`` already gives each chunk the fastest mode that fits, which is optimal per cut.

Objective. Throughput = global batch / step, where the step of a layout is its schedule's simulated
step (``partition``'s exact step-time cut, p2p over the placement's pipeline link) plus the
data-parallel reduction: rank r starts reducing its gradients when its last op ends and the step ends
when the last rank is done, ``step = max_r(end_r + reduce_r)`` (topology.dp_reduce_time over the
replicas' link). So a stage that finishes its backward early (the last stage under 1F1B) reduces
while the first stages drain the pipeline: the reduction overlaps the cooldown, never a rank's own
compute. Other micro-batch sizes come from the profile by costs.rescale.scale_microbatch.

Method: branch and bound over the enumerated layouts.

1. Memory bound. Over all S·v chunks a layout holds at least the whole model's weights, gradients
   and optimizer state as sharded under (R, ZeRO) plus, in every chunk, the fewest in-flight
   micro-batches of its least-keeping recompute mode; each chunk may use the tensors' budget / v
   (the limit less the reserve and a GPU's fixed terms, over its allocator slack: memory.tensor_budget). A
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
   Each chunk's F and B also carry its cuts' send/recv (planner.chunk_costs), so the K − 1 cuts add
   at least 4 one-way sends of the K − 1 smallest cut tensors per micro-batch to Σt. With v > 1
   (interleaved 1F1B, zbv) rank r's first op waits for micro-batch 0's forward through chunks
   0..r−1, and under interleaved 1F1B its last op (chunk r's last backward) is followed by the
   backwards of chunks r−1..0: summed over the ranks, chunk c < S − 1 counts S − 1 − c times, at
   least the smallest layers' times in that order (rearrangement), added to the ranks' chains.
   At solve time a tighter bound is tried first: the least recompute seconds that any cut needs to
   fit (min over cuts, by an O(K·L²) DP, of each chunk's cheapest allowed mode under which its share
   of the budget holds its in-flight micro-batches), times M over S, added to the chains; a layout
   it refutes is skipped unsolved (counted with the bound's prunes).
   Tensor parallelism (``tps``): each degree t is searched over the profile one tp rank sees
   (autopipe.costs.tp.at_tp: its compute divided as it shards, its collectives over the node's
   link) and the cluster of its tp groups (topology.tp_cluster), with bounds of its own; every
   degree's layouts go into the one list below, so the best found at one degree prunes the others.
3. Solve in order of the bound's throughput, best first; stop when the next layout's bound cannot
   beat the ``top``-th best solved (ties are solved, not pruned). Before solving a layout with one
   chunk per rank (gpipe, 1f1b), ask the solver's own bound whether any cut that fits could step
   within what ties the ``top``-th best (planner.partitioner.steps_above, step_solver's docstring
   says why it is sound): its paths all end at rank 0, whose last op ends the pipeline and is
   followed by rank 0's own data-parallel traffic, at least its chunk's gradients (per layer,
   tied tensors taken off), so the reachability runs at that step less the tail of each end of
   rank 0's chunk; refuted layouts are skipped unsolved (counted with the bound's prunes). The
   bounds only ever overstate throughput, so the best ``top`` layouts are exactly those of solving
   every layout.

Complexity: enumeration O(d(N)·d(B)·schedules·ZeRO·2); each bound O(L); each solve one
``partition`` call (see planner/step_solver.py) plus one simulation. Counts of considered, pruned and solved
layouts are in the result.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from typing import Callable, Sequence

from ..choices import ZERO_STAGES
from ..costs.layer_costs import Profile
from ..costs.rescale import profiled_microbatch, scale_microbatch
from ..errors import AutopipeError, InfeasibleMemoryError
from ..planner.cost_model import cpu_rank_excess
from ..planner.memory import layer_memory
from ..planner.options import PartitionOptions
from ..planner.partitioner import fits_memory, resolve_limit, steps_above
from ..planner.targets import restricted_cuts, target_info
from ..progress import Progress, progress_for
from ..units import format_bytes
from ..costs.tp import check_tp
from .evaluate import SearchBounds, evaluate, tp_view
from .layouts import SEARCH_SCHEDULES, Layout, SearchResult, enumerate_layouts
from .topology import Cluster, dp_reduce_time, place, tp_cluster

__all__ = ["search", "target_layouts", "why_nothing_fits"]


def _rank(x: Layout) -> tuple:
    """Best first: throughput, then the smaller peak, then the simpler layout (fewer stages, lower ZeRO)."""
    return (-(x.throughput or 0.0), x.peak_memory or 0, x.stages, x.zero, x.virtual_stages, x.key())


def search(profile: Profile, cluster: Cluster, *, global_batch: int, memory_limit: int | str | None = "device",
           optimizer: str | None = None, recompute: str = "auto", zeros: Sequence[int] = ZERO_STAGES,
           schedules: Sequence[tuple[str, int]] = SEARCH_SCHEDULES, microbatch_sizes: Sequence[int] | None = None,
           top: int = 3, prune: bool = True, weight_share: float | None = None,
           target: str | None = None, progress: bool | Progress = False, tps: Sequence[int] = (1,),
           sequence_parallel: bool = False, eps: Sequence[int] = (1,), workers: int | None = None,
           keep: Callable[[Layout], bool] | None = None) -> SearchResult:  # fmt: skip
    """The layouts of ``cluster`` for ``global_batch`` samples per step, best predicted throughput first.

    ``prune=False`` solves every layout (what the tests compare the pruned search with). Raises
    InfeasibleMemoryError, with what would fit in one line (autopipe.cluster.layout_search), when none fits.
    ``target``: only layouts that engine runs (its schedules, virtual stages, ZeRO stages), each cut
    where it can (autopipe.planner.targets). ``progress``: how the layouts solved are shown
    (autopipe.progress: the caller's display; the search itself prints nothing). ``workers``: processes
    that solve layouts at once (default: one per core when there are many to solve, where the OS forks;
    1: in this process). The best ``top`` are the same on any count; which layouts below them get solved
    before the bar rises (``solved`` and the prunes) depends on the order the workers finish in.
    ``keep``: only the layouts it says yes to are considered (convert: those autopipe's runtime composes).

    Example:
        >>> from autopipe.cluster.topology import cluster_for
        >>> prof = Profile.from_costs([1.0] * 8, param_bytes=[100] * 8, activation_bytes=[10] * 8)
        >>> res = search(prof, cluster_for("cpu", 4, 4), global_batch=8, memory_limit=None)
        >>> res.best.stages * res.best.dp, res.considered >= res.solved
        (4, True)
    """
    clock = time.perf_counter()
    limit, _ = resolve_limit(profile, memory_limit)
    profile_mb = profiled_microbatch(profile)
    degrees = _tp_degrees(profile, cluster, tps)
    todo, considered, pruned_memory, dominated = [], 0, 0, 0
    cuts, most = None, len(profile.layers)
    if target is not None:
        schedules, zeros, cuts = target_layouts(profile, target, schedules, zeros)
        most = len(cuts) + 1
    # one view per tp degree (the profile a tp rank sees, the cluster of its groups), its bounds and its
    # cut cache: every degree's layouts go into one list, best bound first, so a good layout at one
    # degree prunes the others' too
    # (an ep degree's view prices its all-to-alls over the node's link: a bound no placement beats)
    views: dict[tuple[int, int], tuple[Profile, SearchBounds, dict]] = {}
    for t, e in ((t, e) for t in degrees for e in dict.fromkeys(eps)):
        sample = Layout(1, 1, 1, 1, "1f1b", 1, 0, "pipeline-inner", tp=t, sequence_parallel=sequence_parallel and t > 1,
                        ep=e)  # fmt: skip
        prof_t, cluster_t = tp_view(profile, cluster, sample)
        bounds = SearchBounds(prof_t, optimizer, limit, cluster_t, recompute)
        views[t, e] = (prof_t, bounds, {})
        for x in enumerate_layouts(most, cluster, global_batch, schedules=schedules, zeros=zeros,
                                   microbatch_sizes=microbatch_sizes, tp=t, sequence_parallel=sequence_parallel):  # fmt: skip
            if x.dp % e:
                continue
            x = replace(x, ep=e) if e > 1 else x
            if keep is not None and not keep(x):
                continue
            considered += 1
            # ZeRO 3 holds what 2 holds under a pipeline (autopipe.planner.memory), so partition gives it the same
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
    solver = _LayoutSolver(profile, cluster, views, limit=limit, optimizer=optimizer, recompute=recompute,
                           weight_share=weight_share, target=target, cuts=cuts, profile_mb=profile_mb)
    found: list[Layout] = []
    solved = infeasible = pruned_bound = 0
    n_workers = _workers(workers, len(todo))

    def kth() -> float | None:
        """The throughput a layout must beat to enter the top ones; None while fewer are solved."""
        if not prune or len(found) < top:
            return None
        return sorted(found, key=_rank)[top - 1].throughput or 0.0

    def below_bar(i: int, least: float | None) -> bool:
        """Whether todo[i]'s bound cannot beat the top ones: sorted by bound, none after it can either (counted)."""
        nonlocal pruned_bound
        if least is None or todo[i].bound >= least * (1 - 1e-12):
            return False
        pruned_bound += len(todo) - i
        phase.finish(f"the other {len(todo) - i} cannot beat the best {top}")
        return True

    tallied: set[int] = set()  # id() of the layouts whose answer is in

    def tally(x: Layout, kind: str, done: Layout | None) -> None:
        nonlocal solved, infeasible, pruned_bound
        tallied.add(id(x))
        if kind == "pruned":
            pruned_bound += 1
            return
        solved += 1
        phase.advance(what=x.label)
        if kind == "infeasible":
            infeasible += 1
        else:
            found.append(done)  # type: ignore[arg-type]

    def in_process() -> None:  # every layout not answered yet, in bound order, until none can beat the top ones
        for i, x in enumerate(todo):
            if id(x) in tallied:
                continue
            least = kth()
            if below_bar(i, least):
                break
            tally(x, *solver.solve(x, least))

    with progress_for(progress).phase("search", total=len(todo), unit="layouts solved") as phase:
        if n_workers == 1:
            in_process()
        else:  # the same tests, a layout per worker; each result raises the bar for those handed out after it
            global _WORKER
            _WORKER = solver
            try:
                with ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("fork")) as pool:
                    pending: dict = {}  # future -> the layout it solves
                    i = 0
                    while True:
                        while i < len(todo) and len(pending) < 2 * n_workers:
                            least = kth()
                            if below_bar(i, least):
                                i = len(todo)
                                break
                            pending[pool.submit(_solve_in_worker, todo[i], least)] = todo[i]
                            i += 1
                        if not pending:
                            break
                        ready, _ = wait(pending, return_when=FIRST_COMPLETED)
                        for f in ready:
                            tally(pending.pop(f), *f.result())
            except BrokenProcessPool:
                # a worker died (the OS kills the largest process when memory runs out; a forked copy of a
                # large one is a candidate): the answers in stand, the rest are solved here, alike
                warnings.warn(f"a layout-search worker died; solving the {len(todo) - len(tallied)} layouts left "
                              "in this process (workers=1 avoids the pool)", RuntimeWarning, stacklevel=2)
                in_process()
            finally:
                _WORKER = None
    found.sort(key=_rank)
    if not found:
        raise InfeasibleMemoryError(why_nothing_fits(profile, cluster, global_batch=global_batch, limit=limit,
                                                     optimizer=optimizer, recompute=recompute, zeros=zeros,
                                                     tps=degrees, sequence_parallel=sequence_parallel))  # fmt: skip
    # the best layout's Plan, with its own limit, replicas and ZeRO stage (the job's plan.json)
    best, plan = evaluate(profile, cluster, found[0], memory_limit=limit, optimizer=optimizer, recompute=recompute,
                          weight_share=weight_share, target=target)  # fmt: skip
    if (best.step_time or 0.0) > (found[0].step_time or 0.0) * (1 + 1e-9):
        # the unconstrained cut beat the limited search's (a heuristic schedule): keep that cut
        best, plan = evaluate(profile, cluster, found[0], memory_limit=limit, optimizer=optimizer,
                              recompute=recompute, weight_share=weight_share, method="manual",
                              boundaries=found[0].boundaries, target=target)  # fmt: skip
        plan = replace(plan, method="autopipe") if plan is not None else plan
    found[0] = replace(best, bound=found[0].bound)  # the plan's own figures (its cut may tie at a lower peak)
    return SearchResult(
        layouts=tuple(found), gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node, bandwidth_intra=cluster.intra,
        bandwidth_inter=cluster.inter, global_batch=global_batch, memory_limit=limit, considered=considered,
        pruned_memory=pruned_memory, pruned_bound=pruned_bound, pruned_dominated=dominated, solved=solved, infeasible=infeasible,
        seconds=time.perf_counter() - clock, top=top, plan=plan,
    )  # fmt: skip


class _LayoutSolver:
    """Solves one layout of a search: the tighter bounds against the bar (``kth``: the throughput the
    top ones reach, None while fewer are solved), the memory reachability, then ``evaluate``. It keeps
    caches across the layouts it solves (one per worker when the search runs on several)."""

    def __init__(self, profile: Profile, cluster: Cluster, views: dict, *, limit: int | None, optimizer: str | None,
                 recompute: str, weight_share: float | None, target: str | None, cuts: tuple[int, ...] | None,
                 profile_mb: int) -> None:  # fmt: skip
        self.profile, self.cluster, self.views = profile, cluster, views
        self.limit, self.optimizer, self.recompute = limit, optimizer, recompute
        self.weight_share, self.target, self.cuts, self.profile_mb = weight_share, target, cuts, profile_mb
        self._fitting: dict[tuple, bool] = {}
        self._per_size: dict[tuple[int, int, int], Profile] = {}

    def solve(self, x: Layout, kth: float | None) -> tuple[str, Layout | None]:
        """("pruned", None): a bound proves x below the bar; ("infeasible", None): no cut fits;
        ("found", x solved)."""
        _prof_t, bounds, cache = self.views[x.tp, x.ep]
        scale = x.microbatch_size / self.profile_mb
        if kth is not None:
            # the tighter bound, with the recompute every cut needs to fit (method, step 2)
            if bounds.throughput_with_recompute(x, scale) < kth * (1 - 1e-12):
                return "pruned", None
            # one chunk per rank: the solver's own bound at the step that would tie the top ones (step 3)
            # (each of its paths ends at rank 0, which then reduces what its chunk holds)
            tie = x.global_batch / (kth * (1 - 1e-12)) * (1 + 1e-9)
            opts = _options(x, bounds, self.limit, self.optimizer, self.recompute, self.weight_share, self.target)
            if x.virtual_stages == 1 and steps_above(self.scaled(x), opts, tie, _reduce_seconds(
                    x, self.scaled(x), bounds.cluster, self.optimizer)):  # fmt: skip
                return "pruned", None
        if self.limit is not None and not self.fits(x):
            return "infeasible", None  # known from one reachability, no solve (or explanation) needed
        try:
            done, _ = evaluate(self.profile, self.cluster, x, memory_limit=self.limit, optimizer=self.optimizer,
                               recompute=self.recompute, weight_share=self.weight_share, cache=cache,
                               target=self.target)  # fmt: skip
        except InfeasibleMemoryError:
            return "infeasible", None
        return "found", done

    def fits(self, x: Layout) -> bool:
        """fits_memory for x, once for the layouts that differ in placement alone (it prices no link)."""
        key = (x.tp, x.ep, x.microbatch_size, x.stages, x.microbatches, x.schedule, x.virtual_stages, x.dp, x.zero)
        if key not in self._fitting:
            self._fitting[key] = fits_memory(
                self.scaled(x), x.stages, microbatches=x.microbatches, schedule=x.schedule,
                virtual_stages=x.virtual_stages, memory_limit=self.limit, optimizer=self.optimizer,
                recompute=self.recompute, dp=x.dp, zero=x.zero, cuts=self.cuts)  # fmt: skip
        return self._fitting[key]

    def scaled(self, x: Layout) -> Profile:
        """The profile a rank of x's tp/ep view sees at x's micro-batch size, once per (tp, ep, size)."""
        key = (x.tp, x.ep, x.microbatch_size)
        if key not in self._per_size:
            self._per_size[key] = scale_microbatch(self.views[x.tp, x.ep][0], x.microbatch_size)
        return self._per_size[key]


# The solver a forked worker inherits (set by search() just before its pool forks, cleared after).
_WORKER: _LayoutSolver | None = None
PARALLEL_FROM = 64  # layouts left to solve from which ``workers=None`` uses the cores


def _solve_in_worker(x: Layout, kth: float | None) -> tuple[str, Layout | None]:
    assert _WORKER is not None, "a search worker started without its solver"
    return _WORKER.solve(x, kth)


def _workers(asked: int | None, layouts: int) -> int:
    """Processes to solve on: ``asked``, or (None) one per core this process may use when there are
    ``PARALLEL_FROM`` layouts or more and the OS forks (the workers inherit the search's state)."""
    if asked is not None and asked < 1:
        raise AutopipeError(f"workers must be 1 or more, got {asked}.")
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if asked is not None:
        return asked
    if layouts < PARALLEL_FROM:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, 8, layouts // 8))


def _reduce_seconds(x: Layout, profile: Profile, cluster: Cluster, optimizer: str | None) -> list[float]:
    """Per layer, at most the seconds it adds to its rank's data-parallel traffic under x (evaluate's
    ``reduce_r``): the traffic is linear in bytes (topology.dp_reduce_time), and a tied tensor, reduced
    once per rank, is taken off every layer that uses it (so a rank is never charged more)."""
    lm = layer_memory(profile, optimizer)
    g, w = list(lm.gradients), list(lm.weights)
    for _size, users, tw, tg, *_ in lm.tied:
        for i in users:
            g[i], w[i] = g[i] - tg, w[i] - tw
    bw = place(cluster, stages=x.stages, dp=x.dp, order=x.placement).dp_bandwidth
    return [dp_reduce_time(gi, wi, x.dp, bw, x.zero) for gi, wi in zip(g, w)]


def _options(x: Layout, bounds: SearchBounds, limit: int | None, optimizer: str | None, recompute: str,
             weight_share: float | None, target: str | None) -> PartitionOptions:
    """What ``evaluate`` asks ``partition`` for layout x under its limit (its p2p link the placement's)."""
    bw = None if x.stages == 1 else place(bounds.cluster, stages=x.stages, dp=x.dp, order=x.placement).p2p_bandwidth
    return PartitionOptions(x.stages, microbatches=x.microbatches, schedule=x.schedule, memory_limit=limit,
                            virtual_stages=x.virtual_stages, optimizer=optimizer, recompute=recompute, bandwidth=bw,
                            weight_share=weight_share, target=target, dp=x.dp, zero=x.zero)  # fmt: skip


def target_layouts(profile: Profile, target: str, schedules: Sequence[tuple[str, int]],
                   zeros: Sequence[int]) -> tuple[list[tuple[str, int]], list[int], tuple[int, ...]]:  # fmt: skip
    """The schedules and ZeRO stages of the search that ``target`` runs, and the cuts it allows."""
    t = target_info(target)
    kept = [(s, v) for s, v in schedules if s in t.schedules and (t.max_virtual is None or v <= t.max_virtual)]
    zs = [z for z in zeros if z in t.zeros]
    if not kept or not zs:
        raise AutopipeError(f"{t.name} runs none of the schedules or ZeRO stages asked for; it has "
                            f"{', '.join(t.schedules)} and ZeRO {', '.join(map(str, t.zeros))}.")
    cutset = restricted_cuts(profile, 1, None, target)
    assert cutset is not None
    return kept, zs, cutset.cuts


def _tp_degrees(profile: Profile, cluster: Cluster, tps: Sequence[int]) -> list[int]:
    """The asked tp degrees, each checked: dividing a node's devices and the profile's sharded dimensions."""
    out = []
    for t in dict.fromkeys(tps):
        tp_cluster(cluster, t)  # one line when t does not divide the node
        check_tp(profile, t)
        out.append(t)
    if not out:
        raise AutopipeError("no tensor-parallel degree to search; give --tp auto, a number, or a list like 1,8.")
    return out


def why_nothing_fits(profile: Profile, cluster: Cluster, *, global_batch: int, limit: int | None,
                     optimizer: str | None, recompute: str, zeros: Sequence[int], tps: Sequence[int] = (1,),
                     sequence_parallel: bool = False) -> str:  # fmt: skip
    """One line: no layout fits; then what would (recompute auto, ZeRO, more devices, more memory)."""
    head = (f"no layout of {cluster.gpus} devices fits {format_bytes(limit) if limit else 'the memory'} per device "
            f"for a global batch of {global_batch}")  # fmt: skip
    layouts = list(enumerate_layouts(len(profile.layers), cluster, global_batch, schedules=(("1f1b", 1),), zeros=zeros))
    if not layouts:
        return (f"no layout of {cluster.gpus} devices divides a global batch of {global_batch} among its replicas "
                f"(and has at most {len(profile.layers)} stages); use a global batch that is a multiple of the "
                "replica counts, or another --gpus.")  # fmt: skip
    hints: list[str] = []

    def feasible(c: Cluster, **kw) -> bool:  # type: ignore[no-untyped-def]
        opts = dict(global_batch=global_batch, memory_limit=limit, optimizer=optimizer, recompute=recompute,
                    zeros=zeros, schedules=(("1f1b", 1),), microbatch_sizes=(1,), top=1, tps=tps,
                    sequence_parallel=sequence_parallel)  # fmt: skip
        try:
            search(profile, c, **{**opts, **kw})  # type: ignore[arg-type]
        except AutopipeError:
            return False
        return True

    if recompute != "auto" and feasible(cluster, recompute="auto"):
        hints.append("recompute auto (--recompute auto) would fit")
    if set(zeros) != set(ZERO_STAGES) and feasible(cluster, zeros=ZERO_STAGES):
        hints.append("more ZeRO stages (--zero auto) would fit")
    per = cluster.gpus_per_node
    for times in (2, 4, 8, 16, 32, 64):
        bigger = type(cluster)(cluster.gpus * times, per, cluster.intra, cluster.inter)
        if global_batch % times == 0 and feasible(bigger):
            hints.append(f"{bigger.gpus} devices would fit")
            break
    # the least memory among the simplest layouts, each cut with full recompute and no limit
    least = None
    deepest = sorted({x.stages for x in layouts})[-3:]  # deep pipelines hold the least per device
    simple = {(x.stages, x.zero): x for x in layouts if x.microbatch_size == 1 and x.stages in deepest}
    for x in simple.values():
        try:
            done, _ = evaluate(profile, cluster, x, memory_limit=None, optimizer=optimizer, recompute="full")
        except AutopipeError:
            continue
        if least is None or (done.peak_memory or 0) < (least.peak_memory or 0):
            least = done
    if least is not None:
        # on a CPU a rank was measured holding more beyond its tensors than the (mean) reserve the peak counts
        excess = max(0, (cpu_rank_excess(profile) or 0) - profile.reserve_bytes)
        more = ", and what a CPU rank was measured holding beyond its tensors here" if excess else ""
        hints.append(f"{format_bytes((least.peak_memory or 0) + excess)} per device would fit ({least.label}, full "
                     f"recompute{more})")
    return f"{head}: {'; '.join(hints) or 'nothing tried fits'}."
