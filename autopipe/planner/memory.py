"""What a pipeline rank holds at its peak while training, term by term. No torch.

The plan's ``rank_memory`` is this module's ``RankMemory.total``; the step log's measured
``peak_memory`` (``autopipe.runtime.logs.peak``) is its counterpart. Per rank, over the chunks it runs:

- ``weights``, ``gradients``, ``optimizer``: what the layers' parameters hold for the whole step,
  as the profile sized them for the training mode (fp32 master weights and fp32 state under
  autocast; a tied tensor once per rank). Gradients exist from a micro-batch's first backward on
  (the trainer frees them after each update), so they count at the peak.
- ``activations``: each chunk's saved-for-backward bytes per micro-batch times the micro-batches
  its schedule keeps in flight there (``schedules.inflight_counts``). Profiled under autocast they
  include the low-precision copy of each weight autocast saves per micro-batch. With recompute a
  layer keeps only what its mode keeps (``LayerCost.recompute``).
- ``outputs``: each in-flight micro-batch's chunk output, which the schedule holds until that
  micro-batch's backward. A middle chunk's output is saved by the next layer already (and counted
  as its producer's activation); the model's last output (logits, loss) is not, so it is counted
  here, on the rank of the last chunk.
- ``buffers``: torch's PipelineStage allocates one receive buffer per micro-batch for the tensors
  entering a chunk (forward) and for the gradients of those leaving it (backward), once, and keeps
  them across steps: M × the cut's bytes on each side that faces another rank.
- ``sends``: torch's runtime-driven schedules (Interleaved1F1B, ZBVZeroBubble and the other
  ``_PipelineScheduleRuntime`` ones, ``holds_sends``) wait every send only at the step's end, and
  a gloo or NCCL send keeps its tensor alive until then: each micro-batch's chunk output after its
  backward, each input gradient after it is sent. M × the cut's bytes on each side that faces
  another rank, once more. Where zbv hands a tip chunk's output to its neighbour on the same rank,
  torch keeps the hand-off (the input and, after B, its gradient) until the next step: 2 M × the
  cut's bytes. Measured (4 ranks on gloo, the helper's probe of 2026-11-22): an interleaved rank's
  live tensors grow by one cut per F and per B and fall to 0 only at the step's end (16 MiB = 32
  sends x 0.5 MiB); zbv's tip rank holds 4 + 4 MiB of hand-off at the step's end.
- ``transient``: the heaviest one-layer peak the rank sees on top (a layer's temporaries in forward
  or backward, beyond what it saves and the gradients it writes; under recompute, the layer's whole
  activation set rematerialised for one micro-batch).
- ``gathered``: with ZeRO 2 or 3 over dp > 1 replicas, what torch's FSDP2 holds unsharded during
  the step. Under a pipeline schedule ``PipelineStage`` turns resharding and gradient sync off for
  every backward but the step's last, so from a parameter's first use to the step's end its whole
  (unsharded) weight and its whole accumulated gradient live next to the activations.
- ``data_parallel``: with ZeRO 0 or 1 over dp > 1 replicas, what the engine holds beside the
  replicated parameters and their reduced gradients. Under schedules that run whole backwards
  (``ddp_schedule``) the engine is DistributedDataParallel with ``gradient_as_bucket_view``: the
  gradients are its buckets, all-reduced in place, so nothing (measured: bench/bench_zero.py).
  Under zero-bubble schedules it is torch's ``replicate``, FSDP2 with a shard dimension of one: it
  computes with its own copy of the weights (the "all-gather" output over one rank) and accumulates
  the micro-batches' gradients in an unsharded buffer until the step's one all-reduce: weights +
  gradients once more, alive beside the activations (measured: exactly that, on both ranks, against
  a flat all-reduce).
- ``reduce_scatter``: with ZeRO 2 or 3, one layer's whole gradient copied into the reduce-scatter
  input (FSDP2 reduces a unit at a time): at most the largest layer's gradient, counted like a
  transient (the larger of it and the heaviest one-layer peak).

ZeRO stage K over R replicas divides what it shards by R (DeepSpeed's stages, FSDP2's sharding):
K ≥ 1 the optimizer state, K ≥ 2 the gradients at rest, and since FSDP2 shards parameters at rest
whenever it shards gradients, K ≥ 2 the weights at rest too; K = 3 differs from 2 only in
re-gathering parameters for the backward, which pipelining keeps gathered anyway (``ZERO_TERMS``).
- ``optimizer_step``: the optimizer step's temporaries. On a CPU or a GPU the runtime steps AdamW
  with torch's fused kernel, which makes none (``choices.FUSED_ADAM_DEVICES``). Elsewhere it steps
  foreach AdamW, which takes the square root of every ``exp_avg_sq`` of a parameter group at once
  (``torch._foreach_sqrt``): one more state-sized tensor per parameter, alive during the step, after
  the backward has freed the activations. So the peak is the steady terms plus the larger of the
  activation side and this.
- ``allocator``, ``context``, ``workspace``, ``nccl`` (GPU only, the CUDA memory model: per-GPU
  figures in the profile's DeviceInfo, sources in autopipe/costs/gpu_memory.py): the caching
  allocator's reserved-but-free slack as a share of the tensors' peak; the CUDA context; cuBLAS
  workspaces; one NCCL communicator per group the rank is in (the world's, the pipeline's and the
  replicas' when both are larger than one, one per tied tensor held by several ranks) and
  point-to-point buffers per pipeline neighbour.
- ``reserve``: what the runtime holds on the device beyond all of these (on a CPU: what the rank
  allocates outside tensors and the heap's holes among tensors under 64 KiB, a few MiB), measured
  once per device (``Profile.reserve_bytes``).

``--memory-limit device`` is the GPU's memory; the tensors may use what is left after the fixed
terms (context, workspace, NCCL, reserve) divided by one plus the slack (``tensor_budget``).

Example:
    >>> from autopipe.costs.layer_costs import Profile
    >>> prof = Profile.from_costs([1, 1], param_bytes=[400, 400], activation_bytes=[300, 20], output_bytes=[8, 8])
    >>> ranks = rank_memory(prof, (0, 1, 2), stage_ranks=(0, 1), inflight=(2, 1), microbatches=4)
    >>> [(m.activations, m.optimizer_step, m.total) for m in ranks]  # a CPU: fused AdamW, no temporaries
    [(600, 0, 2232), (20, 0, 1660)]
    >>> from dataclasses import replace
    >>> elsewhere = replace(prof, device=DeviceInfo(type="mps"))  # foreach AdamW: rank 1 peaks in its step
    >>> [(m.optimizer_step, m.total) for m in rank_memory(elsewhere, (0, 1, 2), stage_ranks=(0, 1), inflight=(2, 1), microbatches=4)]
    [(400, 2232), (400, 2032)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from ..choices import FUSED_ADAM_DEVICES
from ..costs.layer_costs import DeviceInfo, LayerCost, Profile, optimizer_state_factor
from .schedules import rank_states

__all__ = ["RankMemory", "LayerMemory", "DeviceTerms", "ZeroShare", "ZERO_STAGES", "ddp_schedule", "holds_sends",
           "charged_units", "joint_peak", "layer_memory", "rank_memory", "splits_backward", "tensor_budget", "zero_share"]

ZERO_STAGES = (0, 1, 2, 3)
# schedules that split the backward into input and weight passes (the partitioner's and torch's spellings)
_SPLIT_BACKWARD = {"zbv", "zerobubble", "zbvzerobubble", "interleavedzb", "interleavedzerobubble", "dualpipev"}


def splits_backward(schedule: str) -> bool:
    """Whether ``schedule`` (the partitioner's name or torch's class name) runs each backward as an
    input pass and a deferred weight pass (zero-bubble schedules).

    >>> splits_backward("zbv"), splits_backward("ZBVZeroBubble"), splits_backward("1f1b")
    (True, True, False)
    """
    return _schedule_key(schedule) in _SPLIT_BACKWARD


def _schedule_key(schedule: str) -> str:
    """A schedule's name as the sets above spell it: lower case, no dashes or underscores, and no
    "Schedule" prefix of torch's class names."""
    return schedule.lower().replace("-", "").replace("_", "").removeprefix("schedule")


_RUNTIME_DRIVEN = {"interleaved1f1b", "zbv", "zbvzerobubble", "loopedbfs", "interleavedzerobubble", "dualpipev"}


def holds_sends(schedule: str) -> bool:
    """Whether torch runs ``schedule`` (the partitioner's name or torch's class name) by its action
    runtime (``_PipelineScheduleRuntime``), which waits every send only at the step's end: the sent
    tensors live until then (``RankMemory.sends``). GPipe and 1F1B wait theirs within the step.

    >>> holds_sends("interleaved1f1b"), holds_sends("ZBVZeroBubble"), holds_sends("1f1b"), holds_sends("gpipe")
    (True, True, False, False)
    """
    return _schedule_key(schedule) in _RUNTIME_DRIVEN


def ddp_schedule(schedule: str) -> bool:
    """Whether ZeRO 0/1 run on DistributedDataParallel under ``schedule`` (else on ``replicate``).

    DDP reduces from autograd hooks that a whole ``backward()`` fires; zero-bubble schedules
    compute weight gradients with ``torch.autograd.grad`` and set ``.grad`` by hand, which fires
    none, so there DDP would never reduce (autopipe.runtime.torch_engine.zero).

    >>> ddp_schedule("1f1b"), ddp_schedule("Interleaved1F1B"), ddp_schedule("zbv")
    (True, True, False)
    """
    return not splits_backward(schedule)


@dataclass(frozen=True)
class ZeroShare:
    """What one of R data-parallel replicas holds of a layer under ZeRO stage K (fractions of it)."""

    weights: float = 1.0  # at rest (between steps)
    gradients: float = 1.0
    optimizer: float = 1.0
    gathered: bool = False  # whole weights and gradients live during the step (FSDP2 under pipelining)
    buckets: bool = False  # replicate's own weights + accumulated gradients (DDP's buckets are the gradients)


def zero_share(zero: int, dp: int, *, schedule: str = "1f1b") -> ZeroShare:
    """The ZERO_TERMS row for stage ``zero`` over ``dp`` replicas (dp 1: nothing is sharded or reduced)
    under ``schedule``, which picks ZeRO 0/1's engine (``ddp_schedule``).

    >>> zero_share(1, 4).optimizer, zero_share(3, 4).weights, zero_share(3, 1).weights
    (0.25, 0.25, 1.0)
    >>> zero_share(0, 2).buckets, zero_share(0, 2, schedule="zbv").buckets
    (False, True)
    """
    if zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {ZERO_STAGES}, got {zero!r}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp!r}")
    if dp == 1:
        return ZeroShare()
    part = 1.0 / dp
    if zero <= 1:
        return ZeroShare(optimizer=part if zero == 1 else 1.0, buckets=not ddp_schedule(schedule))
    return ZeroShare(weights=part, gradients=part, optimizer=part, gathered=True)


@dataclass(frozen=True)
class DeviceTerms:
    """The CUDA memory model's per-GPU figures (all 0 on a CPU): see autopipe/costs/gpu_memory.py."""

    context: int = 0
    workspace: int = 0
    nccl_group: int = 0  # one communicator over more than 2 ranks
    nccl_pair: int = 0  # one communicator over 2 ranks
    nccl_peer: int = 0  # point-to-point buffers per pipeline neighbour
    slack: float = 0.0  # the allocator's reserved-but-free share of the tensors' peak

    @classmethod
    def of(cls, device: DeviceInfo) -> "DeviceTerms":
        """The figures a profile's device carries (a CPU's, or an old profile's, are 0)."""
        return cls(int(device.context_bytes), int(device.workspace_bytes), int(device.nccl_group_bytes),
                   int(device.nccl_pair_bytes), int(device.nccl_peer_bytes), float(device.allocator_slack))  # fmt: skip

    def nccl(self, groups: Sequence[int], peers: int) -> int:
        """NCCL's bytes for communicators over groups of these sizes (one rank: none) and ``peers``
        point-to-point neighbours."""
        return sum(self.nccl_pair if n == 2 else self.nccl_group for n in groups if n > 1) + peers * self.nccl_peer


@dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's predicted peak, by what holds it (bytes)."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    outputs: int = 0
    buffers: int = 0
    sends: int = 0
    transient: int = 0
    data_parallel: int = 0
    reserve: int = 0
    gathered: int = 0
    reduce_scatter: int = 0
    optimizer_step: int = 0
    allocator: int = 0
    context: int = 0
    workspace: int = 0
    nccl: int = 0

    @property
    def tensors(self) -> int:
        """The tensors' peak: what lives all step, then the larger of the backward's side (the
        activations in flight and the heaviest one-off on top) and the optimizer step's temporaries."""
        steady = self.weights + self.gradients + self.optimizer + self.buffers + self.sends + self.gathered + self.data_parallel
        return steady + max(self.activations + self.outputs + max(self.transient, self.reduce_scatter), self.optimizer_step)

    @property
    def fixed(self) -> int:
        """What the rank holds whatever its tensors: CUDA context, workspaces, NCCL, the reserve."""
        return self.context + self.workspace + self.nccl + self.reserve

    @property
    def total(self) -> int:
        """The peak: the tensors', the allocator's slack on them, and the fixed terms."""
        return self.tensors + self.allocator + self.fixed

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class LayerMemory:
    """Per-layer byte counts the memory model (and the partitioner) adds up, for one optimizer."""

    weights: tuple[int, ...]
    gradients: tuple[int, ...]
    optimizer: tuple[int, ...]
    activations: dict[str, tuple[int, ...]]  # recompute mode -> saved bytes per micro-batch
    # recompute mode -> bytes per micro-batch held between the input and the weight pass (zero-bubble)
    waiting: dict[str, tuple[int, ...]]
    transient: dict[str, tuple[int, ...]]  # recompute mode -> one-layer peak on top
    outputs: tuple[int, ...]  # bytes leaving each layer (what crosses a cut after it)
    input_bytes: int  # bytes entering layer 0
    # (static size, users, weights, grads, state, gathered, buckets, step temporaries) of each tied
    # tensor, as one rank holds it
    tied: tuple[tuple[int, tuple[int, ...], int, int, int, int, int, int], ...]
    # ZeRO over data-parallel replicas (weights/gradients/optimizer above are this rank's shards)
    gathered: tuple[int, ...] = ()  # per layer: whole weights + gradients held during the step
    buckets: tuple[int, ...] = ()  # per layer: replicate's weight copy + accumulated gradient (ZeRO 0/1)
    reduce_scatter: tuple[int, ...] = ()  # per layer: its reduce-scatter input (ZeRO 2/3), a one-off
    dp: int = 1
    zero: int = 0
    step: tuple[int, ...] = ()  # per layer: the optimizer step's temporaries (this rank's share)
    device: DeviceTerms = DeviceTerms()  # the GPU's fixed terms and slack (zeros on a CPU)

    @property
    def static(self) -> tuple[int, ...]:
        """Per layer, what lives all step: shards at rest, what is gathered, all-reduce buckets."""
        n = len(self.weights)
        return tuple(w + g + o + x + r for w, g, o, x, r in zip(
            self.weights, self.gradients, self.optimizer, self.gathered or (0,) * n, self.buckets or (0,) * n))  # fmt: skip


def layer_memory(profile: Profile, optimizer: str | None = None, *, dp: int = 1, zero: int = 0,
                 schedule: str = "1f1b") -> LayerMemory:
    """The profile's per-layer bytes, with optimizer state recounted for ``optimizer`` if given and
    this rank's shares under ZeRO stage ``zero`` over ``dp`` data-parallel replicas.

    Recompute modes a layer was not profiled for are derived: ``full`` keeps the layer's input (the
    previous layer's output) and rematerialises its activations in backward.
    """
    share = zero_share(zero, dp, schedule=schedule)
    layers = profile.layers
    old = optimizer_state_factor(profile.optimizer)
    new = old if optimizer is None else optimizer_state_factor(optimizer)
    opt = [l.optimizer_bytes if new == old else int(l.param_bytes * new) for l in layers]
    # the step's temporaries: one state-sized tensor per parameter where foreach Adam/AdamW steps
    # (its sqrt of exp_avg_sq), none where the fused kernel does; optimizer_bytes holds the states
    # (and under mixed precision the fp32 master copy)
    states = new + (1 if profile.mixed_precision else 0)
    adam = (optimizer or profile.optimizer).lower() in ("adam", "adamw") and profile.device.type not in FUSED_ADAM_DEVICES
    step = [int(o // states) if adam and states > 0 else 0 for o in opt]
    inputs = [profile.input_bytes] + [l.output_bytes for l in layers[:-1]]
    base_transient = [
        max(l.peak_forward_bytes - l.activation_bytes, l.peak_backward_bytes - l.grad_bytes, 0) for l in layers
    ]
    acts: dict[str, tuple[int, ...]] = {"none": tuple(l.activation_bytes for l in layers)}
    waits: dict[str, tuple[int, ...]] = {}
    trans: dict[str, tuple[int, ...]] = {"none": tuple(base_transient)}
    for mode in ("selective", "full"):
        kept, extra = [], []
        for l, inp, t in zip(layers, inputs, base_transient):
            rc = l.recompute.get(mode)
            if rc is None and mode == "selective":
                rc_bytes = l.activation_bytes  # not profiled: selective keeps what none keeps
            elif rc is None:
                rc_bytes = inp  # not profiled (older profiles): full keeps the layer's input
            else:
                rc_bytes = rc.activation_bytes
            kept.append(rc_bytes)
            # backward rematerialises what the mode did not keep, for one micro-batch at a time
            extra.append(t + max(l.activation_bytes - rc_bytes, 0))
        acts[mode], trans[mode] = tuple(kept), tuple(extra)
    for mode, kept_bytes in acts.items():  # not profiled: a waiting unit holds what a held one does
        waits[mode] = tuple(l.weight_hold_bytes.get(mode, k) for l, k in zip(layers, kept_bytes))
    tied = []
    for name, size in profile.tied_static_bytes.items():
        size = int(size * (2 + new) / (2 + old))  # param + grad + state of one copy, for this optimizer
        users = tuple(i for i, l in enumerate(layers) if name in l.tied)
        if not users:
            continue
        # split the tied tensor's static bytes the way its first user's figures split
        u = layers[users[0]]
        total = max(u.static_bytes, 1)
        w, g = size * u.param_bytes // total, size * u.grad_bytes // total
        sw, sg, so = _shard(w, share.weights), _shard(g, share.gradients), _shard(size - w - g, share.optimizer)
        whole = w + g if share.gathered else 0
        bucket = w + g if share.buckets else 0
        ts = int(so // states) if adam and states > 0 else 0
        tied.append((sw + sg + so + whole + bucket, users, sw, sg, so, whole, bucket, ts))
    # expert slices under ep > 1 sit outside the data-parallel engine, whole on their ranks; under
    # ZeRO 1 the expert optimizer shards them over their expert data-parallel group (dp / ep replicas)
    held = [_expert_part(l) for l in layers]
    eopt = [_expert_optimizer_share(zero, dp, l) for l in layers]

    def split(nbytes: int, f: float, part: float, expert: float = 1.0) -> int:
        # ``expert`` 0: the expert bytes are not in this term at all
        e = int(round(nbytes * f))
        return _shard(nbytes - e, part) + (_shard(e, expert) if expert else 0)

    return LayerMemory(
        weights=tuple(split(l.param_bytes, f, share.weights) for l, f in zip(layers, held)),
        gradients=tuple(split(l.grad_bytes, f, share.gradients) for l, f in zip(layers, held)),
        optimizer=tuple(split(o, f, share.optimizer, e) for o, f, e in zip(opt, held, eopt)),
        activations=acts,
        waiting=waits,
        transient=trans,
        outputs=tuple(l.output_bytes for l in layers),
        input_bytes=profile.input_bytes,
        tied=tuple(tied),
        gathered=tuple(split(l.param_bytes + l.grad_bytes, f, 1.0, 0.0) if share.gathered else 0
                       for l, f in zip(layers, held)),
        buckets=tuple(split(l.param_bytes + l.grad_bytes, f, 1.0, 0.0) if share.buckets else 0
                      for l, f in zip(layers, held)),
        reduce_scatter=tuple(split(l.grad_bytes, f, 1.0, 0.0) if share.gathered else 0 for l, f in zip(layers, held)),
        dp=dp,
        zero=zero,
        step=tuple(split(t, f, share.optimizer, e) for t, f, e in zip(step, held, eopt)),
        device=DeviceTerms.of(profile.device),
    )


def _expert_part(layer: LayerCost) -> float:
    """The share of ``layer``'s parameter bytes that are its expert slices when priced at ep > 1
    (``MoeShape.ep``, set by autopipe.costs.ep.at_ep): ``(π/ep) / (π/ep + 1 − π)`` of the bytes at
    ep, π the experts' share at ep 1. The runtime keeps those out of DDP, ``replicate`` and
    ``fully_shard`` (autopipe.runtime.stage.expert_parallel): they are whole on their ranks at
    every ZeRO stage, never gathered nor bucketed. 0 for a dense layer and at ep 1.

    >>> from autopipe.costs.layer_costs import LayerCost, MoeShape
    >>> shape = MoeShape(experts=4, top_k=1, hidden=8, expert_param_share=0.75, ep=2)
    >>> _expert_part(LayerCost(0, moe=shape)), _expert_part(LayerCost(0))  # 0.375 of 0.625 at ep 2
    (0.6, 0.0)
    """
    shape = layer.moe
    if shape is None or shape.ep <= 1:
        return 0.0
    e = shape.expert_param_share / shape.ep
    return e / (e + 1.0 - shape.expert_param_share)


def _expert_optimizer_share(zero: int, dp: int, layer: LayerCost) -> float:
    """One rank's share of its expert slices' optimizer state: under ZeRO 1 the expert optimizer
    (autopipe.runtime.torch_engine.zero_one.ZeroOneAdamW over the expert data-parallel group) holds
    1 / (dp / ep) of it, as Megatron's and DeepSpeed's distributed optimizers shard experts; ZeRO 0,
    2 and 3 keep it whole beside the slices."""
    shape = layer.moe
    if zero != 1 or shape is None or shape.ep <= 1 or dp <= shape.ep:
        return 1.0
    return shape.ep / dp


def _shard(nbytes: int, part: float) -> int:
    """One replica's share of a tensor's bytes: FSDP2 pads each dim-0 shard up, so round up."""
    return nbytes if part >= 1.0 else -(-nbytes // round(1 / part))


def rank_memory(
    profile: Profile | LayerMemory,
    boundaries: Sequence[int],
    *,
    stage_ranks: Sequence[int],
    inflight: Sequence[int],
    microbatches: int,
    recompute: Sequence[str] = (),
    dp: int = 1,
    zero: int = 0,
    reserve: int | None = None,
    optimizer: str | None = None,
    schedule: str = "1f1b",
    waiting: Sequence[int] = (),
) -> list[RankMemory]:
    """Each pipeline rank's peak for a cut: chunk c is ``boundaries[c]:boundaries[c+1]`` on rank
    ``stage_ranks[c]`` with ``inflight[c]`` micro-batches held and recompute mode ``recompute[c]``
    (default none), each stage replicated ``dp`` times with ZeRO stage ``zero`` under ``schedule``
    (which also says whether sends are held to the step's end, ``holds_sends``; its ZeRO engine is
    ignored when ``profile`` is a LayerMemory: it carries its own). ``reserve`` defaults to the profile's.

    Each chunk counts ``inflight[c]`` micro-batches, ``waiting[c]`` of them past their input pass and
    holding ``LayerMemory.waiting`` until their weight pass (zero-bubble; default none): the sum of
    the chunks' own peaks (each in its heaviest state, ``schedules.peak_states``), which never falls
    below the rank's."""
    lm = profile if isinstance(profile, LayerMemory) else layer_memory(profile, optimizer, dp=dp, zero=zero,
                                                                        schedule=schedule)
    if reserve is None:
        reserve = profile.reserve_bytes if isinstance(profile, Profile) else 0
    n = len(lm.weights)
    gathered = lm.gathered or (0,) * n
    buckets = lm.buckets or (0,) * n
    scatter = lm.reduce_scatter or (0,) * n
    chunks = list(zip(boundaries, boundaries[1:]))
    modes = list(recompute) or ["none"] * len(chunks)
    sends = holds_sends(schedule)
    ranks = max(stage_ranks) + 1
    step = lm.step or (0,) * n
    dev = lm.device
    owner_of = {i: stage_ranks[c] for c, (a, b) in enumerate(chunks) for i in range(a, b)}
    out: list[RankMemory] = []
    for r in range(ranks):
        mine = [c for c, owner in enumerate(stage_ranks) if owner == r]
        layers = sorted({i for c in mine for i in range(*chunks[c])})
        w = sum(lm.weights[i] for i in layers)
        g = sum(lm.gradients[i] for i in layers)
        o = sum(lm.optimizer[i] for i in layers)
        x = sum(gathered[i] for i in layers)
        dpb = sum(buckets[i] for i in layers)
        temp = sum(step[i] for i in layers)
        for _size, users, tw, tg, to, tx, tb, *rest in lm.tied:  # a tied tensor: once per rank, not per user layer
            extra = sum(1 for i in layers if i in users) - 1
            if extra > 0:
                w, g, o, x, dpb = w - extra * tw, g - extra * tg, o - extra * to, x - extra * tx, dpb - extra * tb
                temp -= extra * (rest[0] if rest else 0)
        act = outs = buf = trans = sent = 0
        for c in mine:
            a, b = chunks[c]
            # held units keep the forward's bytes, waiting ones what their weight pass needs
            late = int(waiting[c]) if len(waiting) else 0
            held = inflight[c] - late
            kept, hold, output = _unit_bytes(lm, a, b, modes[c])
            act += held * kept + late * hold
            outs += held * output
            trans = max([trans, *(lm.transient[modes[c]][i] for i in range(a, b))])
            # one buffer per micro-batch for each cut facing another rank
            if a > 0 and stage_ranks[c - 1] != r:
                buf += microbatches * lm.outputs[a - 1]
            if b < n and stage_ranks[c + 1] != r:
                buf += microbatches * lm.outputs[b - 1]
            if sends and b < n and stage_ranks[c + 1] == r:  # a hand-off on this rank
                sent += 2 * microbatches * lm.outputs[b - 1]
        if sends:
            sent += buf  # every send of the step, alive until its end
        mem = RankMemory(
            weights=w, gradients=g, optimizer=o, activations=act, outputs=outs, buffers=buf, sends=sent,
            transient=trans, data_parallel=dpb, reserve=int(reserve), gathered=x,
            reduce_scatter=max((scatter[i] for i in layers), default=0), optimizer_step=temp,
        )  # fmt: skip
        if dev != DeviceTerms():
            # the GPU's terms: the allocator's slack on the tensors, context, workspaces, NCCL
            peers = {stage_ranks[d] for c in mine for d in (c - 1, c + 1)
                     if 0 <= d < len(chunks) and stage_ranks[d] != r}  # fmt: skip
            tied_ranks = [{owner_of[i] for i in users} for _size, users, *_ in lm.tied]
            groups = _groups(ranks, lm.dp, [len(t) for t in tied_ranks if r in t and len(t) > 1])
            mem = replace(mem, allocator=_ceil(dev.slack * mem.tensors), context=dev.context, workspace=dev.workspace,
                          nccl=dev.nccl(groups, len(peers)))  # fmt: skip
        out.append(mem)
    return out


def _unit_bytes(memory: LayerMemory, a: int, b: int, mode: str) -> tuple[int, int, int]:
    """What one micro-batch of chunk [a, b) holds under recompute ``mode``: held (between its F and
    B) its kept activations, waiting (between B and W) what its weight pass needs, and, held on the
    model's last chunk, the model's output too (it lives until its B)."""
    out = memory.outputs[-1] if b == len(memory.weights) else 0
    return sum(memory.activations[mode][a:b]), sum(memory.waiting[mode][a:b]), out


def charged_units(memory: LayerMemory, boundaries: Sequence[int], *, schedule: str, stages: int, virtual: int,
                  microbatches: int, inflight: Sequence[int], waiting: Sequence[int],
                  recompute: Sequence[str] = ()) -> tuple[list[int], list[int]]:  # fmt: skip
    """Per chunk, the (inflight, waiting) a plan charges its rank with: each chunk's own peak
    (``inflight``, ``waiting``) where a rank runs one chunk, the chunks' joint peak
    (:func:`joint_peak` over ``schedules.rank_states``) where it runs ``virtual`` > 1. The one rule
    for the partitioner's plan and the cluster search's layouts, so the two report one peak."""
    if virtual == 1:
        return list(inflight), list(waiting)
    return joint_peak(memory, boundaries, recompute=recompute,
                      states=rank_states(schedule, stages, virtual, microbatches))  # fmt: skip


def joint_peak(memory: LayerMemory, boundaries: Sequence[int], *, states: Sequence[tuple[Sequence[int], Sequence]],
               recompute: Sequence[str] = ()) -> tuple[list[int], list[int]]:
    """Per chunk, the (inflight, waiting) to give ``rank_memory`` so each rank is charged at its
    heaviest joint state (``schedules.rank_states``: per rank, its chunks and the (held, waiting) of
    each at every point of its op order) rather than at each chunk's own peak: on a rank with several
    chunks the units of one are freed while another's arrive, and the sum of the chunks' own peaks
    over-charges it (measured, 2026-11-29: GPT-2 interleaved 1F1B's ranks held 0.84-0.87 of that sum
    once glibc's heap stopped hiding it; bench/results/accuracy.md). Only the activations and the
    model's output depend on the state; the rest of a rank's terms are the same in every one.

    >>> from autopipe.costs.layer_costs import Profile
    >>> lm = layer_memory(Profile.from_costs([1, 1, 1, 1], activation_bytes=[100, 100, 300, 100]))
    >>> joint_peak(lm, (0, 1, 2, 3, 4), states=[((0, 2), (((4, 0), (1, 0)), ((3, 0), (2, 0)))),
    ...                                          ((1, 3), (((2, 0), (2, 0)),))])
    ([3, 2, 2, 2], [0, 0, 0, 0])

    Rank 0 peaks holding 3 x 100 + 2 x 300 bytes, where its chunks' own peaks add to 4 x 100 + 2 x 300.
    """
    chunks = list(zip(boundaries, boundaries[1:]))
    modes = list(recompute) or ["none"] * len(chunks)
    held_bytes, wait_bytes = [], []
    for c, (a, b) in enumerate(chunks):
        kept, hold, output = _unit_bytes(memory, a, b, modes[c])
        held_bytes.append(kept + output)
        wait_bytes.append(hold)
    inflight, waiting = [0] * len(chunks), [0] * len(chunks)
    for mine, seen in states:
        best = max(seen, key=lambda st: sum(h * held_bytes[c] + w * wait_bytes[c] for c, (h, w) in zip(mine, st)))
        for c, (h, w) in zip(mine, best):
            inflight[c], waiting[c] = h + w, w
    return inflight, waiting


def _groups(stages: int, dp: int, tied: Sequence[int]) -> list[int]:
    """The sizes of the process groups a rank of a ``stages`` x ``dp`` layout runs NCCL over: the
    world's; the pipeline's and the replicas' where both exceed one (else one of them is the world
    and torch's DeviceMesh reuses its communicator); one per tied tensor it shares (``tied``)."""
    world = [stages * dp]
    split = [stages, dp] if stages > 1 and dp > 1 else []
    return world + split + list(tied)


def _ceil(x: float) -> int:
    return int(-(-x // 1))


def tensor_budget(memory: LayerMemory, limit: int, *, stages: int, reserve: int = 0) -> int:
    """What one rank's tensors may use of ``limit`` bytes per device: the limit less the fixed terms
    of the rank that has the most (CUDA context, workspaces, NCCL: every tied tensor shared, two
    pipeline neighbours; and the runtime ``reserve``), divided by one plus the allocator's slack. On
    a CPU (no such terms) the limit less the reserve.

    >>> from autopipe.costs.layer_costs import DeviceInfo, Profile
    >>> prof = Profile.from_costs([1, 1], param_bytes=[400, 400])
    >>> tensor_budget(layer_memory(prof), 10_000, stages=2, reserve=1_000)
    9000
    >>> gpu = DeviceInfo(type="cuda", context_bytes=500, nccl_group_bytes=300, nccl_pair_bytes=200, allocator_slack=0.25)
    >>> tensor_budget(layer_memory(replace(prof, device=gpu)), 10_000, stages=2)  # (10000 - 500 - 200) / 1.25
    7440
    """
    dev = memory.device
    tied = [min(len(users), stages) for _size, users, *_ in memory.tied if len(users) > 1] if stages > 1 else []
    peers = min(stages - 1, 2)
    fixed = dev.context + dev.workspace + dev.nccl(_groups(stages, memory.dp, tied), peers) + int(reserve)
    return int((limit - fixed) // (1 + dev.slack))
