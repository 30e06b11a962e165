"""The profile as the partitioner sees it: per-chunk seconds and bytes for one (optimizer, bandwidth,
schedule, micro-batch count, replicas, ZeRO stage), and the states in which a chunk can peak. No torch.

Bytes come from autopipe/planner/memory.py (the same figures the plan's per-rank memory adds up);
seconds from the profile; any chunk ``[a, b)`` is then O(1) through autopipe/planner/chunk_costs.py.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from ..costs.engines import EngineCosts
from ..costs.layer_costs import Profile
from ..costs.noise import noise_note
from ..errors import PartitionError
from .chunk_costs import ChunkCosts
from .memory import holds_sends, layer_memory, tensor_budget
from .schedules import peak_states

__all__ = ["CostModel", "CutRequest", "recompute_times", "unit_states"]


@dataclass(frozen=True)
class CutRequest:
    """What every ZeRO stage's attempt at a cut shares: the schedule's shape, the limit, the policy."""

    stages: int  # pipeline ranks S
    v: int  # chunks per rank
    m: int  # micro-batches per step
    schedule: str
    limit: int | None  # bytes per device; None: unlimited
    limit_source: str  # "given", "device" or ""
    recompute: str  # the policy: none, selective, full or auto
    weight_share: float  # the backward's W part under zero-bubble schedules
    states: list[tuple[tuple[int, int], ...]]  # per chunk, the (units, waiting) states that can be its peak
    signature: str  # the profiled sequence's, carried into the Plan
    zero_policy: str  # the ZeRO stage asked for ("auto" or a stage), carried into the Plan
    cuts: tuple[int, ...] | None = None  # the only layers a chunk may start at (an engine's); None: any
    target: str = ""  # the engine those cuts are for (autopipe.planner.targets), carried into the Plan


class CostModel:
    """The profile as per-chunk costs, for one (optimizer, bandwidth, schedule, micro-batch count).

    Bytes come from autopipe.planner.memory (the same figures the plan's per-rank memory adds up); seconds
    from the profile, plus, with ``engine``, what that engine adds per op and per send, and how much
    longer the layers take inside its jobs than alone (measured: autopipe.costs.engines). On zbv a recomputed layer runs its forward again in each of its two backward
    passes (input, then weight gradients), so its extra time counts twice.
    """

    def __init__(self, profile: Profile, optimizer: str | None, bandwidth: float | None,
                 schedule: str = "1f1b", microbatches: int = 1, dp: int = 1, zero: int = 0,
                 engine: EngineCosts | None = None) -> None:  # fmt: skip
        layers = profile.layers
        self.engine = engine
        self.names = [layer.name or f"layer{i}" for i, layer in enumerate(layers)]
        self.optimizer = (optimizer or profile.optimizer).lower()
        self.dp, self.zero = dp, zero
        # a CPU profile's cores: ranks beyond them share them (the plan's shared_step_time)
        self.cores = profile.device.cores if profile.device.type == "cpu" else 0
        # the schedule picks ZeRO 0/1's engine, and so what it holds (autopipe.planner.memory.ddp_schedule)
        lm = layer_memory(profile, optimizer, dp=dp, zero=zero, schedule=schedule)
        self.memory = lm
        static = list(lm.static)
        tied = []
        # (users, parameters, one copy's gradient bytes) per tied tensor, for after_schedule: stepped once
        # per rank holding it, its gradient summed over those ranks
        self.tied_params: list[tuple[list[int], int, int]] = []
        for size, users, *rest in lm.tied:
            for i in users:
                if static[i] < size:
                    raise PartitionError(
                        f"layer {i} ({self.names[i]}) lists a tied tensor of {size} bytes but holds only "
                        f"{static[i]} static bytes; its figures must include the tied tensor. Profile again."
                    )
            tied.append((size, list(users), rest[-1]))  # rest[-1]: its step temporaries
            # rest[0]: its weight bytes, in parameters at its first user's bytes per parameter (fp32 where unknown)
            first = layers[users[0]]
            per_byte = first.params / first.param_bytes if first.params and first.param_bytes else 0.25
            self.tied_params.append((list(users), round(rest[0] * per_byte), int(rest[1])))
        bw = float("inf") if bandwidth is None else float(bandwidth)
        if not bw > 0:
            raise PartitionError(f"bandwidth must be > 0 bytes/s, got {bandwidth}.")
        self.bandwidth = bw
        # a send at a cut: its bytes over the link, plus the engine's measured latency per send
        latency = engine.send_latency if engine is not None else 0.0
        self.one_way = [l.output_bytes / bw + latency for l in layers[:-1]]
        passes = 2 if schedule == "zbv" else 1
        # the layers as long as they take inside this engine's jobs on this device (measured), not alone
        scale = engine.compute_scale if engine is not None else 1.0
        modes = {name: ([scale * passes * x for x in extra], list(lm.activations[name]))
                 for name, extra in recompute_times(profile).items()}  # fmt: skip
        # each layer's backward inside the whole model: its time alone plus its share of what the
        # whole model took beyond its layers timed alone (profiler)
        whole = [scale * (l.backward_time + l.backward_gap) for l in layers]
        backward, first = whole, None
        split = profile.split_backward if schedule == "zbv" else None
        if split is not None:
            # zbv runs each backward as two passes, which take longer together than the whole one: by
            # the ratio timed per layer (a layer without a timed split at the timed layers' ratio),
            # never under 1. The ratio scales the layer's backward inside the model, not a difference
            # of alone timings: on a busy machine those ran 3-4x the in-model figures and B + W came
            # out from half to twice the whole, so a difference carried the load into the plan (and
            # once a negative time).
            # A layer's own ratio counts up to the timed layers' together (the blocks', as they are most
            # of them): the LM head's split timed alone read 1.23 (GPT-2) and 1.46 (Llama, bf16) of its
            # whole backward, where inside zbv jobs its B + W took 0.96 and 1.3 of it (per action, the
            # stage's calls timed: bench/results/accuracy.md).
            ratio = [max(1.0, min((l.backward_input_time + l.backward_weight_time) / l.backward_time, split[1])
                         if l.split_timed else split[1]) for l in layers]  # fmt: skip
            backward = [w * r for w, r in zip(whole, ratio)]
            # torch's zbv never splits the first stage (its B skips it, its W runs the whole backward);
            # a negative in-model span, scaled by the ratio, would come out under it
            first = [min(w, b) for w, b in zip(whole, backward)]
        self.costs = ChunkCosts(
            [scale * (l.forward_time + l.forward_gap) for l in layers],
            backward,
            self.one_way,
            static,
            list(lm.activations["none"]),
            tied,
            modes,
            # ZeRO 2/3's reduce-scatter input is a one-off like a layer's transient: the larger counts
            transient={name: [max(x, r) for x, r in zip(t, lm.reduce_scatter or (0,) * len(t))]
                       for name, t in lm.transient.items()},  # fmt: skip
            held=lm.outputs[-1] if lm.outputs else 0,
            hold=lm.waiting,
            # receive buffers, and under torch's runtime-driven schedules the sends held to the step's end
            buffers=microbatches * (2 if holds_sends(schedule) else 1),
            cut_bytes=list(lm.outputs[:-1]),
            step=list(lm.step),
            per_op=engine.per_op if engine is not None else 0.0,
            first_backward=first,
        )
        self.reserve = profile.reserve_bytes
        # what a CPU rank was measured holding beyond its tensors (refusals.held_beside): None off a CPU
        self.rank_excess = cpu_rank_excess(profile)
        self.limit_reserve = limit_reserve(profile)  # what a memory limit leaves a rank beyond its tensors
        self.noise = noise_note(profile)  # said beside every step predicted from this profile (Plan.profile_noise)
        self.params = [l.params or l.param_bytes for l in layers]
        self.param_counts = [l.params or l.param_bytes // 4 for l in layers]  # fp32 where only bytes are known
        self.tied = tied

    def after_schedule(self, bounds: Sequence[int], ranks: Sequence[int], stages: int) -> float:
        """Seconds a step spends after the schedule (norm, optimizer step: ``EngineCosts.after_schedule``;
        the all-reduce of each tied tensor's gradient over the ranks holding it, for each of them)
        on its slowest rank: every rank waits for the global norm, so the step ends with the slowest.
        0 without engine costs. Not minimised by the solver: it moves with the largest rank's
        parameters only (the cut of the schedule's step decides the plan)."""
        if self.engine is None:
            return 0.0
        held = [0] * stages
        owner: dict[int, int] = {}
        for c, (a, b) in enumerate(zip(bounds, bounds[1:])):
            held[ranks[c]] += sum(self.param_counts[a:b])
            owner.update(dict.fromkeys(range(a, b), ranks[c]))
        reduce = [0.0] * stages
        for users, count, grad in self.tied_params:
            holders = Counter(owner[i] for i in users)
            summed = self.engine.allreduce_time(grad, len(holders))
            for r, k in holders.items():  # each user's count includes the tied tensor: once per rank
                held[r] -= (k - 1) * count
                reduce[r] += summed
        return max(self.engine.after_schedule(p) + t for p, t in zip(held, reduce))

    def budget(self, limit: int, stages: int) -> int:
        """What a rank's tensors may use of ``limit`` (``memory.tensor_budget``): the limit less
        the GPU's fixed terms and the reserve (on a CPU, what a rank was measured holding beyond its
        tensors where more: ``limit_reserve``), less the allocator's slack."""
        return tensor_budget(self.memory, limit, stages=stages, reserve=self.limit_reserve)

    def allowed(self, recompute: str) -> tuple[int, ...]:
        """Indices (into costs.modes) of the modes a chunk may use under a recompute policy."""
        modes = self.costs.modes
        if recompute == "auto":
            return tuple(range(len(modes)))
        if recompute not in modes:
            raise PartitionError(
                f"recompute={recompute!r}: the profile has no per-layer figures for it (it has "
                f"{', '.join(modes)}); use recompute='auto' or 'full', or profile again with a version that "
                "measures selective recompute."
            )
        return (modes.index(recompute),)


def cpu_rank_excess(profile: Profile) -> int | None:
    """For the ranks of a CPU job (a measured or estimated CPU profile, not plain numbers), the most
    one was measured holding beyond its tensors (``Profile.rank_excess_bytes``; 0: not measured);
    None for any other profile, whose advice counts the reserve alone."""
    if profile.device.type != "cpu" or profile.mode == "given":
        return None
    return profile.rank_excess_bytes


def limit_reserve(profile: Profile) -> int:
    """What a memory limit must leave a rank beyond its tensors: the reserve, or for a CPU job's ranks
    the most one was measured holding beyond them where that is more (``cpu_rank_excess``). A limit is
    a ceiling every rank must stay under, and the reserve is the probe's ranks' mean: a CPU plan cut
    under a limit of tensors + reserve ran its ranks at several times it (issue 41). The prediction
    (``rank_memory``) keeps the mean. Equal to the reserve for every profile before the excess was kept."""
    return max(profile.reserve_bytes, cpu_rank_excess(profile) or 0)


def recompute_times(profile: Profile) -> dict[str, list[float]]:
    """Per recompute mode, the seconds it adds to each layer's backward: "full" is the layer's
    forward where not measured; "selective" is present when the profile measured it (a layer with
    no selective figures recomputes nothing, as under none)."""
    layers = profile.layers
    full = [l.recompute.get("full") for l in layers]
    times = {"full": [r.extra_backward_time if r else l.forward_time for l, r in zip(layers, full)]}
    if any("selective" in l.recompute for l in layers):
        times["selective"] = [l.recompute["selective"].extra_backward_time if "selective" in l.recompute else 0.0
                              for l in layers]  # fmt: skip
    return times


def unit_states(schedule: str, stages: int, v: int, m: int) -> list[tuple[tuple[int, int], ...]]:
    """Per chunk, the (micro-batches held, of them waiting for their weight pass) states that can be
    its peak: ``schedules.peak_states`` as ChunkCosts counts them (units = held + waiting).

    Two neighbouring states whose common upper corner (the more held, the more waiting) adds at most
    1/16 of the chunk's units are charged as that corner, never less than either: each state costs
    the solver a window per chunk, and at 64 stages (88 held, 0 waiting) and (87, 1) are one state
    for every purpose but a 1 % difference. Below 16 units nothing is merged."""
    out = []
    for st in peak_states(schedule, stages, v, m):
        merged = [st[0]]
        for h, w in st[1:]:
            ph, pw = merged[-1]  # more held, fewer waiting than (h, w)
            if min(ph - h, w - pw) * 16 <= ph + pw:
                merged[-1] = (ph, w)
            else:
                merged.append((h, w))
        out.append(tuple((h + w, w) for h, w in merged))
    return out
