"""One layout of the cluster search solved, and the cheap bounds that decide which layouts are worth
solving (autopipe/cluster/layout_search.py's method, steps 1 and 2). No torch."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from ..costs.layer_costs import Profile
from ..costs.rescale import scale_microbatch, tokens_per_sample
from ..costs.ep import at_ep
from ..costs.links import link_bandwidth
from ..costs.tp import at_tp
from ..planner.cost_model import limit_reserve, recompute_times
from ..planner.memory import LayerMemory, charged_units, layer_memory, rank_memory, tensor_budget
from ..planner.options import PartitionOptions
from ..planner.partitioner import fits_memory, partition, resolve_limit
from ..planner.plan import Plan
from ..planner.schedules import chunk_ranks, inflight_counts, rank_ends
from ..planner.targets import restricted_cuts
from .layouts import Layout
from .topology import Cluster, cluster_for, dp_reduce_time, place, tp_cluster

__all__ = ["SearchBounds", "evaluate", "node_ep_view", "node_tp_view", "step_bound", "tp_view"]


class SearchBounds:
    """The cheap bounds of the module docstring for one profile (at its own micro-batch size)."""

    def __init__(self, profile: Profile, optimizer: str | None, limit: int | None, cluster: Cluster,
                 recompute: str = "auto") -> None:  # fmt: skip
        self.profile, self.optimizer, self.limit, self.cluster = profile, optimizer, limit, cluster
        self.recompute = recompute
        self._extra = recompute_times(profile)
        self.work = sum(profile.times)
        base = layer_memory(profile, optimizer)
        # a tied tensor's repeats may all sit on one rank: leave them out of what must be reduced
        self.grads = sum(base.gradients) - sum((len(u) - 1) * tg for _s, u, _w, tg, *_ in base.tied)
        self.weights = sum(base.weights) - sum((len(u) - 1) * tw for _s, u, tw, *_ in base.tied)
        self._static: dict[tuple[int, int], tuple[int, int, LayerMemory]] = {}
        # what every cut's pipeline pays beyond the layers (module docstring of layout_search, step 2):
        # the smallest cut bytes, ascending, and the layer times, ascending, for the fill of v > 1
        self.cut_bytes = sorted(l.output_bytes for l in profile.layers[:-1])
        # layer 0's backward may run shorter as the first chunk's (no input gradient): its forward alone
        fb = [l.forward_time + l.forward_gap for l in profile.layers]
        self.fill_fb = sorted([fb[0]] + [l.time for l in profile.layers[1:]])
        self.fill_f = sorted(fb)

    def _memory(self, dp: int, zero: int) -> tuple[int, int, LayerMemory]:
        """(static bytes of the whole model, least activation bytes per micro-batch, the per-layer
        figures) under (dp, zero)."""
        if (dp, zero) not in self._static:
            # DDP's terms (the default schedule's): no more than replicate's, so still a lower bound under zbv
            lm = layer_memory(self.profile, self.optimizer, dp=dp, zero=zero)
            static = sum(lm.static) - sum((len(u) - 1) * size for size, u, *_ in lm.tied)
            acts = sum(min(col) for col in zip(*lm.activations.values()))
            self._static[(dp, zero)] = (static, acts, lm)
        return self._static[(dp, zero)]

    def fits(self, x: Layout, scale: float) -> bool:
        if self.limit is None:
            return True
        static, acts, lm = self._memory(x.dp, x.zero)
        least = min(inflight_counts(x.schedule, x.stages, x.virtual_stages, x.microbatches))
        chunk = tensor_budget(lm, self.limit, stages=x.stages, reserve=limit_reserve(self.profile)) // x.virtual_stages
        return chunk > 0 and static + least * acts * scale <= x.stages * x.virtual_stages * chunk

    def throughput(self, x: Layout, scale: float) -> float:
        k, s = x.stages * x.virtual_stages, x.stages
        p2p = place(self.cluster, stages=s, dp=x.dp, order=x.placement).p2p_bandwidth
        # every chunk's F and B each carry its cuts' send/recv (planner.chunk_costs: comm_in + comm_out),
        # so the K - 1 cuts add 4 one-way sends per micro-batch at least: the K - 1 smallest
        comm = 0.0 if s == 1 else 4.0 * sum(self.cut_bytes[: k - 1]) / p2p
        fill = 0.0
        if x.virtual_stages > 1 and s > 1:
            # rank r's first op waits for micro-batch 0's forward through chunks 0..r-1 (each on another
            # rank, each of one layer at least); under interleaved 1F1B its last op (chunk r's last
            # backward) is followed by the backwards of chunks r-1..0. Summed over r, chunk c < S - 1
            # counts S - 1 - c times: at least the smallest layers, the smallest the most often
            times = self.fill_fb if x.schedule == "interleaved1f1b" else self.fill_f
            fill = sum((s - 1 - j) * times[j] for j in range(min(s - 1, len(times))))
        return x.global_batch / step_bound(x, (self.work + comm) * scale, self.grads, self.weights, self.cluster,
                                           fill=fill * scale)  # fmt: skip


    def recompute_floor(self, x: Layout, scale: float) -> float:
        """The least recompute seconds per micro-batch that any cut of ``x`` needs to fit: min over
        cuts of Σ_chunks the cheapest allowed mode under which the chunk fits its share of the
        budget, holding its schedule's in-flight micro-batches (schedules.inflight_counts). The bytes
        are the memory model's less what only adds (tied repeats, transients, waiting units, the ZeRO
        buckets), so a chunk refused here is refused there: a lower bound, O(K·L²) with numpy.
        Under zbv (whose units count the weight pass's waiting ones apart) every chunk is charged the
        fewest any chunk holds, as the memory bound does; inf: no cut fits."""
        if self.limit is None:
            return 0.0
        _static, _acts, lm = self._memory(x.dp, x.zero)
        modes = [m for m in lm.activations if self.recompute in ("auto", m)]
        if not modes:
            return 0.0
        k, v = x.stages * x.virtual_stages, x.virtual_stages
        budget = tensor_budget(lm, self.limit, stages=x.stages, reserve=limit_reserve(self.profile)) // v
        held = inflight_counts(x.schedule, x.stages, v, x.microbatches)
        if x.schedule == "zbv":
            held = [min(held)] * len(held)
        tied = np.zeros(len(lm.static))
        for size, users, *_ in lm.tied:  # as if every tied tensor were free: never above the model's bytes
            for i in users:
                tied[i] += size
        static = np.concatenate([[0.0], np.cumsum(np.maximum(np.asarray(lm.static, float) - tied, 0.0))])
        sab = static[None, :] - static[:, None]
        upper = np.triu(np.ones_like(sab, dtype=bool), 1)  # a < b
        acts = {m: np.concatenate([[0.0], np.cumsum(np.asarray(lm.activations[m], float))]) for m in modes}
        extra = {m: np.concatenate([[0.0], np.cumsum(np.asarray(self._extra.get(m, [0.0] * len(lm.static)), float))])
                 for m in modes if m != "none"}  # fmt: skip
        mode_pairs = [(acts[m][None, :] - acts[m][:, None], 0.0 if m == "none" else extra[m][None, :] - extra[m][:, None])
                      for m in modes]  # fmt: skip
        best = np.full(len(static), np.inf)
        best[0] = 0.0
        cache: dict[int, np.ndarray] = {}
        for c in range(k):
            units = held[c]
            if units not in cache:
                e = np.full(sab.shape, np.inf)
                for aab, eab in mode_pairs:
                    ok = upper & (sab + units * scale * aab <= budget)
                    e = np.where(ok, np.minimum(e, eab * scale if isinstance(eab, np.ndarray) else 0.0), e)
                cache[units] = e
            best = np.min(best[:, None] + cache[units], axis=0)
        return float(best[-1])

    def throughput_with_recompute(self, x: Layout, scale: float) -> float:
        """The throughput bound with the recompute any cut needs added to the ranks' chains (0 where
        nothing fits: no cut of x fits, so nothing there can beat anything)."""
        floor = self.recompute_floor(x, scale)
        if not np.isfinite(floor):
            return 0.0
        base = x.global_batch / self.throughput(x, scale)
        return x.global_batch / (base + x.microbatches * floor / x.stages)


def step_bound(x: Layout, work: float, grads: float, weights: float, cluster: Cluster, *, fill: float = 0.0) -> float:
    """A lower bound on the step of every cut of layout ``x`` (module docstring, step 2): ``work`` is
    one micro-batch's forward + backward seconds through the whole model (its least send/recv
    included), ``fill`` (v > 1) the ranks' summed waits before their first op and after their last."""
    bw = place(cluster, stages=x.stages, dp=x.dp, order=x.placement).dp_bandwidth
    m, s = x.microbatches, x.stages
    reduce = dp_reduce_time(grads, weights, x.dp, bw, x.zero)
    chains = (m * work + reduce) / s
    if x.virtual_stages > 1:
        return chains + fill / s
    c = 1.0 / (1.0 - (1.0 - 1.0 / m) ** s)
    # the weights' smallest, (c - 1)/(M - 1) on stage 0, times every rank's reduction after its last op
    return max(chains, c * work + (0.0 if m == 1 else (c - 1.0) / (m - 1) * reduce))


def tp_view(profile: Profile, cluster: Cluster, x: Layout) -> tuple[Profile, Cluster]:
    """The profile one tp rank of layout ``x`` sees (costs.tp.at_tp, its collectives over the node's
    link) and the cluster of its tp groups (topology.tp_cluster): what the pipeline and the replicas
    are solved on. tp 1: both as they are. The profile is taken to tp before any micro-batch
    rescaling, so every bound and solve of the search prices the same figures."""
    prof, members = profile, cluster
    if x.tp > 1:
        prof = at_tp(profile, x.tp, sequence_parallel=x.sequence_parallel, bandwidth=cluster.intra,
                     expert_parallel=x.ep > 1)
        members = tp_cluster(cluster, x.tp)
    if x.ep > 1:  # the ep group, ep consecutive replicas: in one node when the replicas are and tp · ep fits
        inside = x.dp_link != "inter" and x.tp * x.ep <= cluster.gpus_per_node
        prof = at_ep(prof, x.ep, bandwidth=cluster.intra if inside else cluster.inter)
    return prof, members


def node_tp_view(profile: Profile, tp: int, *, gpus: int, gpus_per_node: int | None = None,
                 bandwidth_intra: float | None = None, sequence_parallel: bool = False, ep: int = 1) -> Profile:
    """The profile one rank of a tp group of ``tp`` sees for a fixed layout of ``gpus`` devices (plan
    --stages --tp, convert --tp): its collectives over the node's link unless ``bandwidth_intra`` is
    given: a CPU profile's host's measured all-reduce bandwidth (costs.links), else the profile's
    device's default (topology.LINKS); one line when ``tp`` does not divide a node."""
    name = profile.device.name if profile.device.type != "cpu" else "cpu"
    intra = bandwidth_intra if bandwidth_intra is not None else link_bandwidth(profile, "all_reduce")
    cluster = cluster_for(name, gpus, gpus_per_node, intra, 1.0)
    tp_cluster(cluster, tp)
    return at_tp(profile, tp, sequence_parallel=sequence_parallel, bandwidth=cluster.intra, expert_parallel=ep > 1)


def node_ep_view(profile: Profile, ep: int, *, gpus: int, dp: int, tp: int = 1, gpus_per_node: int | None = None,
                 bandwidth_intra: float | None = None, bandwidth_inter: float | None = None,
                 skew: str = "p95") -> Profile:  # fmt: skip
    """The profile one rank of an ep group of ``ep`` sees for a fixed layout of ``gpus`` devices (plan
    --ep; convert --ep calls this too): the ep group is ep consecutive dp ranks, each a tp group of
    consecutive devices, so its all-to-alls cross the node's link when tp · ep devices fit in a node,
    else the inter-node one (the profile's device's defaults, topology.LINKS, unless given; a CPU
    profile's node link is its host's measured all-to-all bandwidth, costs.links). Apply it to
    the profile one tp rank sees (node_tp_view) when both are > 1. One line when ep does not divide dp."""
    from ..errors import PartitionError

    if ep > 1 and dp % ep:
        raise PartitionError(f"--ep {ep} does not divide the {dp} data-parallel replicas; use an ep that divides "
                             f"--dp (experts are sharded over ep of the replicas).")
    if ep == 1:
        return at_ep(profile, 1, bandwidth=1.0, skew=skew)
    name = profile.device.name if profile.device.type != "cpu" else "cpu"
    intra = bandwidth_intra if bandwidth_intra is not None else link_bandwidth(profile, "all_to_all")
    cluster = cluster_for(name, gpus, gpus_per_node, intra, bandwidth_inter)
    link = cluster.intra if tp * ep <= cluster.gpus_per_node else cluster.inter
    return at_ep(profile, ep, bandwidth=link, skew=skew)


def evaluate(profile: Profile, cluster: Cluster, x: Layout, *, memory_limit: int | str | None = "device",
             optimizer: str | None = None, recompute: str = "auto", method: str = "autopipe",
             boundaries: Sequence[int] | None = None, weight_share: float | None = None,
             cache: dict | None = None, target: str | None = None) -> tuple[Layout, Plan | None]:  # fmt: skip
    """Solve layout ``x`` (or price a given cut / baseline method on it): the Layout with its
    predictions filled in, and its Plan. Raises InfeasibleMemoryError when no cut fits.

    With a ``cache`` (a dict the caller keeps across layouts) the cut is first solved without a
    memory limit, once for every ZeRO stage and replica count that share the schedule, micro-batches
    and link (the limit is the only thing they change in ``partition``); when that cut fits this
    layout's memory, chunk by chunk as partition requires, it is this layout's optimum too and no
    further solve is needed. The Plan is then None (``partition`` gives it again when wanted).
    """
    whole = cluster
    profile, cluster = tp_view(profile, cluster, x)
    prof = scale_microbatch(profile, x.microbatch_size)
    p = place(cluster, stages=x.stages, dp=x.dp, order=x.placement)
    bw = None if x.stages == 1 else p.p2p_bandwidth
    # what every solve of this layout shares; the one under its limit adds the limit, the sharding and the cut
    unlimited = PartitionOptions(x.stages, microbatches=x.microbatches, schedule=x.schedule, memory_limit=None,
                                 virtual_stages=x.virtual_stages, optimizer=optimizer, recompute=recompute, bandwidth=bw,
                                 weight_share=weight_share, target=target)  # fmt: skip
    # an engine's cuts (autopipe.planner.targets): the memory test and every solve keep to them
    cuts = None if target is None else restricted_cuts(prof, x.stages * x.virtual_stages, None, target)
    cuts = None if cuts is None else cuts.cuts
    plan: Plan | None = None
    limit, _ = resolve_limit(profile, memory_limit)
    plain = "none" if recompute == "auto" else recompute  # what the unlimited cut's chunks run
    if cache is not None and limit is not None and not fits_memory(
            prof, x.stages, microbatches=x.microbatches, schedule=x.schedule, virtual_stages=x.virtual_stages,
            memory_limit=limit, optimizer=optimizer, recompute=plain, dp=x.dp, zero=x.zero, cuts=cuts):  # fmt: skip
        cache = None  # no cut fits without recompute, so the unlimited cut cannot either: solve with the limit
    source: Plan | None = None  # the plan whose cut and seconds this layout takes
    peak: int | None = None
    if cache is not None and method == "autopipe" and boundaries is None:
        key = (x.stages, x.microbatch_size, x.microbatches, x.schedule, x.virtual_stages, bw)
        if key not in cache:
            cache[key] = partition(prof, options=unlimited)
        peak = _peak_if_fits(prof, cache[key], x, optimizer, limit)
        source = cache[key] if peak is not None else None
    if source is None:
        plan = source = partition(prof, options=replace(unlimited, memory_limit=memory_limit, dp=x.dp, zero=x.zero,
                                                        method=method, boundaries=boundaries))  # fmt: skip
        # the links were priced for this numbering of the ranks on these nodes: the job must run it
        plan = replace(plan, placement=x.placement, gpus_per_node=whole.gpus_per_node, tp=x.tp,
                       sequence_parallel=x.sequence_parallel, ep=x.ep)  # fmt: skip
        peak = plan.peak_memory
    assert peak is not None
    cut, modes, rec = source.boundaries, source.stage_recompute, source.stage_recompute_time
    fwd, bwd, comm = source.stage_forward, source.stage_backward, source.stage_comm
    ends = rank_ends(source.schedule, forward=fwd, backward=bwd, comm=comm, ranks=source.stages,
                     microbatches=source.microbatches, weight_share=source.weight_share)  # Plan.simulate's
    owners = chunk_ranks(x.schedule, x.stages, x.virtual_stages)
    lm = layer_memory(prof, optimizer)
    step = reduce_max = 0.0
    for r, end in enumerate(ends):
        held = sorted({i for c, owner in enumerate(owners) if owner == r for i in range(cut[c], cut[c + 1])})
        g, w = sum(lm.gradients[i] for i in held), sum(lm.weights[i] for i in held)
        for _size, users, tw, tg, *_ in lm.tied:  # a tied tensor is reduced once per rank
            extra = max(sum(1 for i in held if i in users) - 1, 0)
            g, w = g - extra * tg, w - extra * tw
        red = dp_reduce_time(g, w, x.dp, p.dp_bandwidth, x.zero)
        reduce_max = max(reduce_max, red)
        step = max(step, end + red)
    m, s, k = x.microbatches, x.stages, len(cut) - 1
    tokens = tokens_per_sample(profile)
    done = replace(
        x, step_time=step, pipeline_time=max(ends, default=0.0), reduce_time=reduce_max, throughput=x.global_batch / step,
        tokens_per_second=None if tokens is None else x.global_batch * tokens / step, peak_memory=int(peak),
        fits=limit is None or peak <= limit, recompute=tuple(modes), boundaries=tuple(cut),
        ideal_time=m * sum(fwd[c] + bwd[c] - rec[c] for c in range(k)) / s, recompute_time=m * sum(rec) / s,
        p2p_time=m * 2 * sum(comm) / s,
    )  # fmt: skip
    return done, plan


def _peak_if_fits(prof: Profile, free: Plan, x: Layout, optimizer: str | None, limit: int | None) -> int | None:
    """The rank peak of the unconstrained cut ``free`` under x's replicas and ZeRO stage, if each of its
    chunks fits the tensors' budget / v as partition requires; else None."""
    lm = layer_memory(prof, optimizer, dp=x.dp, zero=x.zero, schedule=x.schedule)
    common = dict(inflight=free.stage_inflight, microbatches=free.microbatches, recompute=free.stage_recompute,
                  reserve=prof.reserve_bytes, waiting=free.stage_waiting, schedule=x.schedule)  # fmt: skip
    joint = dict(common)  # a rank's chunks charged as partition's plan charges them
    joint["inflight"], joint["waiting"] = charged_units(
        lm, free.boundaries, schedule=x.schedule, stages=x.stages, virtual=x.virtual_stages,
        microbatches=free.microbatches, inflight=free.stage_inflight, waiting=free.stage_waiting,
        recompute=free.stage_recompute)  # fmt: skip
    ranks = rank_memory(lm, free.boundaries, stage_ranks=free.stage_ranks, **joint)  # type: ignore[arg-type]
    peak = max(r.total for r in ranks)
    if limit is None:
        return peak
    if x.virtual_stages == 1:  # on a CPU a rank may hold more beyond its tensors than the reserve: the limit counts it
        return peak if peak - prof.reserve_bytes + limit_reserve(prof) <= limit else None
    chunks = rank_memory(lm, free.boundaries, stage_ranks=tuple(range(free.num_chunks)), **common)  # type: ignore[arg-type]
    share = tensor_budget(lm, limit, stages=x.stages, reserve=limit_reserve(prof)) // x.virtual_stages
    return peak if all(c.tensors <= share for c in chunks) else None
