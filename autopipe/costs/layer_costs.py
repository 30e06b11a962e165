"""The Profile record: what each layer costs, saved as JSON with a schema version.

The profile pass produces it; the partition pass reads it. Users with their own cost model build one
from plain numbers with :meth:`Profile.from_costs`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Sequence

from ..choices import RECOMPUTE_MODES
from ..errors import RecordError
from ..files import check_header, read_json, write_json_atomic

__all__ = ["LayerCost", "RecomputeCost", "TpShape", "MoeShape", "DeviceInfo", "Profile", "PROFILE_SCHEMA", "optimizer_state_factor"]

PROFILE_SCHEMA = 1

# With no separate forward/backward figures, backward is taken as twice the forward: the usual ratio
# for matmul-dominated layers (one matmul forward, two backward: input and weight gradients).
_FORWARD_SHARE = 1.0 / 3.0




@dataclass(frozen=True)
class RecomputeCost:
    """What one layer costs per micro-batch under one recompute mode, beside its plain figures."""

    activation_bytes: int  # saved for backward per micro-batch under this mode (replaces LayerCost's)
    extra_backward_time: float  # seconds the recomputation adds to the layer's backward


@dataclass(frozen=True)
class TpShape:
    """What tensor parallelism divides in one layer, per micro-batch at the profiled size.

    Found on the traced layer (autopipe.costs.tp_shape: the matmuls over a parameter weight, colwise
    when their input is replicated, rowwise when it is a colwise output's sharded descendant, and the
    ops between them on sharded data); priced at a degree by autopipe.costs.tp (no torch). Shares are
    of this layer's own figures, so the record is independent of the device the times came from.
    """

    split_forward: float = 0.0  # share of the forward's seconds in ops over sharded data (divided by tp)
    split_backward: float = 0.0  # the same share of the backward's seconds
    param_share: float = 0.0  # share of the parameter bytes in sharded weights (and so of grads, optimizer state)
    activation_share: float = 0.0  # share of the bytes kept for backward that are sharded intermediates
    # bytes of each collective tp adds: an all-reduce after each rowwise matmul (and the vocab-sharded
    # embedding) in forward; one per distinct colwise input in backward; an all-gather of each colwise
    # output that no rowwise matmul consumes (an output layer's logits, gathered whole)
    allreduce_forward: tuple[int, ...] = ()
    allreduce_backward: tuple[int, ...] = ()
    gather_forward: tuple[int, ...] = ()
    divisor: int = 0  # a degree must divide it (sharded features, attention heads); 0: nothing to shard
    source: str = "traced"
    # bytes of the floating [batch, seq, ...] tensors the layer outputs (the residual stream): what
    # sequence parallelism sends as pieces and a layer gathers whole (0: not recorded; the price then
    # takes the layer's whole output_bytes)
    sequence_bytes: int = 0
    # measured on the profile's host (autopipe.runtime.checks.tp_timing): (degree, sequence parallel,
    # forward ratio, backward ratio), the layer's seconds as the runtime runs it at that degree (DTensor,
    # collectives left out) over its seconds at tp 1, timed beside each other; where one is recorded for
    # the degree asked, autopipe.costs.tp prices the layer's compute by it instead of the shares above
    timed: tuple[tuple[int, bool, float, float], ...] = ()

    def timed_at(self, t: int, sequence_parallel: bool) -> tuple[float, float] | None:
        """The measured (forward, backward) ratios at degree ``t``, or None where none was timed."""
        for degree, sp, f, b in self.timed:
            if degree == t and sp == sequence_parallel:
                return f, b
        return None

    @property
    def pairs(self) -> bool:
        """Whether the layer has a colwise→rowwise region (what sequence parallelism extends)."""
        return bool(self.allreduce_forward) and bool(self.allreduce_backward)


def _quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile of ``values`` by linear interpolation between order statistics (numpy's default)."""
    v = sorted(values)
    if not v:
        return 0.0
    pos = q * (len(v) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


@dataclass(frozen=True)
class MoeShape:
    """One mixture-of-experts layer's experts and how its router spread tokens over them.

    Found on the untouched model (autopipe.costs.moe_shape: a hook on its experts module counts the
    router's top-k indices over real batches); priced at an expert-parallel degree by
    autopipe.costs.ep (no torch). ``loads`` holds, per batch seen, the routed slots (token × top-k)
    each expert received: the skew is read from them, at any degree's expert->rank blocks.
    """

    experts: int
    top_k: int
    hidden: int
    tokens: int = 0  # tokens per micro-batch at the profiled size (rows × positions)
    dispatch_bytes: int = 0  # one all-to-all's whole send per micro-batch: tokens × top_k × hidden × bytes
    expert_param_share: float = 0.0  # share of the layer's parameter bytes in the routed experts
    expert_forward_share: float = 0.0  # share of the layer's forward FLOPs in the routed experts
    expert_activation_bytes: int = 0  # bytes the experts keep for backward per micro-batch
    loads: tuple[tuple[int, ...], ...] = ()  # per batch, per expert: routed slots
    # the ep runner's own ops (sort, gather, put back, weight) per micro-batch, forward and backward:
    # timed on the profiling host (autopipe.runtime.checks.ep_timing), 0 where not timed (an estimate)
    local_forward: float = 0.0
    local_backward: float = 0.0
    # the expert-parallel degree the layer's figures are priced at (autopipe.costs.ep.at_ep sets it):
    # its parameter bytes then hold 1/ep of the experts, which the memory model keeps out of ZeRO's shares
    ep: int = 1

    def shares(self) -> tuple[float, ...]:
        """Each expert's mean share of the routed slots over the batches seen."""
        total = sum(sum(b) for b in self.loads)
        if not total:
            return tuple(1.0 / self.experts for _ in range(self.experts))
        return tuple(sum(b[e] for b in self.loads) / total for e in range(self.experts))

    def rank_shares(self, ep: int) -> list[float]:
        """Per batch, the busiest ep rank's share of the slots, experts in contiguous blocks
        ``[r·E/ep, (r+1)·E/ep)`` on rank r (as the runtime places them)."""
        per = max(1, self.experts // max(ep, 1))
        out = []
        for b in self.loads:
            total = sum(b) or 1
            out.append(max(sum(b[r * per:(r + 1) * per]) for r in range(max(ep, 1))) / total)
        return out

    def busiest(self, q: float = 0.95, ep: int = 0) -> float:
        """The q-quantile over batches of the busiest expert's share (``ep`` > 0: the busiest rank's)."""
        if not self.loads:
            return 1.0 / (ep or self.experts)
        return _quantile(self.rank_shares(ep or self.experts), q)


@dataclass(frozen=True)
class LayerCost:
    """What one layer of a LayerSequence costs per micro-batch.

    Times are seconds (medians of repeated runs when measured); bytes are bytes.
    """

    index: int
    name: str = ""
    forward_time: float = 0.0
    backward_time: float = 0.0
    forward_spread: float = 0.0  # interquartile range of the forward samples
    backward_spread: float = 0.0
    params: int = 0  # number of parameter elements (tied ones counted in every layer using them)
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0  # optimizer state plus fp32 master weights under mixed precision
    activation_bytes: int = 0  # saved for backward, per micro-batch
    peak_forward_bytes: int = 0  # transient peak above inputs+params during forward
    peak_backward_bytes: int = 0
    output_bytes: int = 0  # bytes of the tuple leaving the layer (what crosses a cut after it)
    flops: float = 0.0  # forward FLOPs, when known
    tied: tuple[str, ...] = ()  # names of tied parameters this layer holds a copy of
    structure: str = ""  # identical layers share this key and are measured once
    source: str = "measured"  # measured | reused | estimated | given
    # mode ("selective", "full") -> its cost; a mode absent here was not measured for this layer
    recompute: dict[str, RecomputeCost] = field(default_factory=dict)
    # the backward as zero-bubble schedules split it: input gradients, then weight gradients
    # (seconds; both 0 when not measured: estimated, given, or no split to time)
    backward_input_time: float = 0.0
    backward_weight_time: float = 0.0
    # recompute mode -> bytes a micro-batch holds between those two passes, waiting for its weight
    # gradients (on the same ledger as activation_bytes); a mode absent here was not measured
    weight_hold_bytes: dict[str, int] = field(default_factory=dict)
    # What this layer's forward (backward) took inside the whole model beyond its own figure above
    # (autopipe.costs.in_model: caches, and on a CPU page faults, a layer timed alone does not meet);
    # signed seconds per micro-batch, part of ``time`` and of every plan's stage times. 0: not measured.
    forward_gap: float = 0.0
    backward_gap: float = 0.0
    # What tensor parallelism divides in this layer (None: not found, as in profiles made before it)
    tp: TpShape | None = None
    # Its routed experts and their measured token loads (None: not a mixture-of-experts layer, or a
    # profile made before they were recorded)
    moe: MoeShape | None = None

    @property
    def time(self) -> float:
        """Forward plus backward time as the layer runs inside the whole model (its gaps included)."""
        return self.forward_time + self.backward_time + self.forward_gap + self.backward_gap

    @property
    def split_timed(self) -> bool:
        """Whether the zero-bubble split of this layer's backward was measured."""
        return self.backward_input_time > 0 and self.backward_weight_time > 0 and self.backward_time > 0

    @property
    def static_bytes(self) -> int:
        """Memory held for the whole step: parameters, gradients, optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass(frozen=True)
class DeviceInfo:
    """The device a profile was measured on (or estimated for)."""

    name: str = "cpu"
    type: str = "cpu"  # cpu | cuda | meta
    memory_bytes: int = 0  # 0 when unknown
    peak_flops: float = 0.0  # per second, for the dtype profiled; 0 when unknown
    memory_bandwidth: float = 0.0  # bytes per second; 0 when unknown
    threads: int = 0
    # CPU cores the profiling process could run on (CPU profiles; 0 on GPUs and in older profiles): a CPU
    # job whose ranks outnumber them shares them, which the plan's step counts (schedules.shared_step).
    cores: int = 0
    # Seconds of :func:`autopipe.costs.devices.host_probe` on the profiling host (CPU profiles; 0 where not
    # measured): an engine table fitted on another CPU scales its runtime overheads by the ratio.
    host_probe: float = 0.0
    # On a GPU, what a training process holds there beyond its tensors, for the memory model
    # (autopipe.costs.gpu_memory says what each is and where its figure comes from); 0 elsewhere,
    # and in profiles made before they were modelled.
    context_bytes: int = 0  # the CUDA context
    workspace_bytes: int = 0  # cuBLAS workspaces
    nccl_group_bytes: int = 0  # per NCCL communicator over more than 2 ranks
    nccl_pair_bytes: int = 0  # per NCCL communicator over 2 ranks
    nccl_peer_bytes: int = 0  # per point-to-point peer (pipeline neighbour)
    allocator_slack: float = 0.0  # the caching allocator's reserved-but-free share of the tensors' peak
    # On a CPU, the host's gloo collectives as measured (autopipe.runtime.checks.links): kind
    # (all_reduce, all_to_all, all_gather, reduce_scatter, count_exchange) -> (latency s, bytes/s);
    # autopipe.costs.links prices tp and ep with them. Empty on GPUs and in older profiles.
    links: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Profile:
    """Per-layer costs of a flattened model plus how and where they were obtained.

    Example:
        >>> prof = Profile.from_costs(times=[1.0, 2.0, 2.0, 1.0])
        >>> round(prof.layers[1].time, 6)
        2.0
    """

    layers: tuple[LayerCost, ...]
    device: DeviceInfo = field(default_factory=DeviceInfo)
    dtype: str = "float32"
    mode: str = "given"  # measured | estimated | given
    microbatch: dict[str, list[int]] = field(default_factory=dict)  # input name -> shape
    input_bytes: int = 0  # bytes of the tuple entering layer 0
    optimizer: str = "adamw"
    mixed_precision: bool = False
    torch_version: str = ""
    signature: str = ""  # of the model and flatten options; "" when unknown
    model: str = ""
    # Tied parameters: canonical name -> param+grad+optimizer bytes of that one tensor. A layer's
    # figures include the tied tensors it uses (LayerCost.tied lists them by canonical name), so a
    # stage holding several such layers subtracts the repeats: one copy per stage.
    tied_static_bytes: dict[str, int] = field(default_factory=dict)
    # Tied parameters: canonical name -> seconds to add two gradients of that tensor (out of place, as
    # autograd sums the uses of one tensor in a backward). A stage holding k uses pays k - 1 of them
    # per micro-batch; stages holding one use each all-reduce instead. Not charged by the partitioner.
    tied_grad_time: dict[str, float] = field(default_factory=dict)
    # The dtype autocast ran the layers in ("" when it did not): the mode train.py trains in, fp32
    # parameters with 16-bit matmuls, whose saved low-precision weight copies are activations.
    autocast: str = ""
    # Bytes the training runtime holds on this device beyond the model's tensors (allocator, process
    # group, traced graph), measured once per device; part of every rank's predicted peak.
    reserve_bytes: int = 0
    # On a CPU, the most a rank of the reserve's probe held beyond the memory model's prediction for it
    # (autopipe.runtime.checks.reserve: the reserve is the ranks' mean, so a rank may hold this much
    # more); what memory advice sets beside the tensors. 0: not measured (given, estimated, a GPU).
    rank_excess_bytes: int = 0
    # The whole model's forward and backward seconds per micro-batch, measured after the layers with
    # each layer's span marked (autopipe.costs.in_model; 0: not measured): the layers' times add up to them.
    sequence_forward_time: float = 0.0
    sequence_backward_time: float = 0.0
    # What the profiler noticed that makes its figures doubtful (identical layers that disagreed,
    # timings that stayed noisy): said wherever the profile is shown.
    warnings: tuple[str, ...] = ()
    # How disturbed the timings were, in figures (autopipe.costs.noise judges them; 0: not measured,
    # estimated, or a profile made before these fields): the whole model's runs' interquartile range
    # over their median (autopipe.costs.in_model); the largest ratio between identical layers timed
    # twice (the profiler then keeps the faster); the host's 1-minute load average when profiling ended.
    timing_spread: float = 0.0
    twin_ratio: float = 0.0
    host_load: float = 0.0
    schema: int = PROFILE_SCHEMA

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "warnings", tuple(self.warnings))
        _check_layers(self.layers)
        for label, value in (("input_bytes", self.input_bytes), ("reserve_bytes", self.reserve_bytes),
                             ("rank_excess_bytes", self.rank_excess_bytes)):
            _check_number(value, f"profile {label}", integer=True)
        for label in ("sequence_forward_time", "sequence_backward_time", "timing_spread", "twin_ratio", "host_load"):
            _check_number(getattr(self, label), f"profile {label}")
        for name, size in self.tied_static_bytes.items():
            _check_number(size, f"tied_static_bytes[{name!r}]", integer=True)
        for name, seconds in self.tied_grad_time.items():
            _check_number(seconds, f"tied_grad_time[{name!r}]")

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def times(self) -> list[float]:
        return [layer.time for layer in self.layers]

    @classmethod
    def from_costs(
        cls,
        times: Sequence[float],
        param_bytes: Sequence[int] | None = None,
        activation_bytes: Sequence[int] | None = None,
        output_bytes: Sequence[int] | None = None,
        *,
        forward_times: Sequence[float] | None = None,
        names: Sequence[str] | None = None,
        optimizer: str = "adamw",
    ) -> "Profile":
        """Build a profile from plain numbers, one per layer.

        ``times`` are forward+backward seconds. ``forward_times`` splits them; by default the forward
        is a third. Gradients take as many bytes as parameters; Adam/AdamW state twice as many,
        SGD with momentum as many, plain SGD none.

        Example:
            >>> Profile.from_costs([1, 1], param_bytes=[4, 8]).layers[1].optimizer_bytes
            16
        """
        n = len(times)
        for label, values in (
            ("param_bytes", param_bytes),
            ("activation_bytes", activation_bytes),
            ("output_bytes", output_bytes),
            ("forward_times", forward_times),
            ("names", names),
        ):
            if values is not None and len(values) != n:
                raise RecordError(
                    f"from_costs: {label} has {len(values)} values but times has {n}; give one per layer."
                )
        if any(t < 0 for t in times):
            raise RecordError("from_costs: times must be >= 0.")
        state_factor = optimizer_state_factor(optimizer)
        layers = []
        for i, total in enumerate(times):
            fwd = forward_times[i] if forward_times is not None else total * _FORWARD_SHARE
            pb = int(param_bytes[i]) if param_bytes is not None else 0
            layers.append(
                LayerCost(
                    index=i,
                    name=names[i] if names is not None else f"layer{i}",
                    forward_time=float(fwd),
                    backward_time=float(total) - float(fwd),
                    param_bytes=pb,
                    grad_bytes=pb,
                    optimizer_bytes=int(pb * state_factor),
                    activation_bytes=int(activation_bytes[i]) if activation_bytes is not None else 0,
                    output_bytes=int(output_bytes[i]) if output_bytes is not None else 0,
                    source="given",
                )
            )
        return cls(layers=tuple(layers), optimizer=optimizer, mode="given")

    @property
    def split_backward(self) -> tuple[float, float] | None:
        """The measured split of the backward zero-bubble schedules run, over the layers it was timed
        on: (W / (B + W), (B + W) / the whole backward). None when no layer's split was timed."""
        timed = [l for l in self.layers if l.split_timed]
        if not timed:
            return None
        b = sum(l.backward_input_time for l in timed)
        w = sum(l.backward_weight_time for l in timed)
        return w / (b + w), (b + w) / sum(l.backward_time for l in timed)

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = "autopipe.profile"
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        check_header(d, "profile", PROFILE_SCHEMA, "profile the model again with this version")
        d = dict(d)
        d.pop("kind")
        layer_names = {f.name for f in fields(LayerCost)}
        layers = []
        for ld in d.pop("layers"):
            ld = {k: v for k, v in ld.items() if k in layer_names}
            ld["tied"] = tuple(ld.get("tied", ()))
            ld["recompute"] = {m: RecomputeCost(**rc) for m, rc in (ld.get("recompute") or {}).items()}
            if ld.get("tp") is not None:
                tp = {k: v for k, v in ld["tp"].items() if k in _TP_FIELDS}
                for k in ("allreduce_forward", "allreduce_backward", "gather_forward"):
                    tp[k] = tuple(int(b) for b in tp.get(k, ()))
                tp["timed"] = tuple((int(t), bool(sp), float(f), float(b)) for t, sp, f, b in tp.get("timed", ()))
                ld["tp"] = TpShape(**tp)
            if ld.get("moe") is not None:
                moe = {k: v for k, v in ld["moe"].items() if k in _MOE_FIELDS}
                moe["loads"] = tuple(tuple(int(c) for c in b) for b in moe.get("loads", ()))
                ld["moe"] = MoeShape(**moe)
            layers.append(LayerCost(**ld))
        dev = dict(d.pop("device"))
        dev["links"] = {k: (float(v[0]), float(v[1])) for k, v in (dev.get("links") or {}).items()}
        device = DeviceInfo(**dev)
        known = {f.name for f in fields(cls)}
        return cls(layers=tuple(layers), device=device, **{k: v for k, v in d.items() if k in known})

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Profile":
        return cls.from_dict(read_json(path, "profile"))

    def with_layers(self, layers: Sequence[LayerCost]) -> "Profile":
        return replace(self, layers=tuple(layers))


_TP_FIELDS = {f.name for f in fields(TpShape)}
_MOE_FIELDS = {f.name for f in fields(MoeShape)}
_TIMES = ("forward_time", "backward_time", "forward_spread", "backward_spread", "flops", "backward_input_time",
          "backward_weight_time")
_BYTES = ("params", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "peak_forward_bytes",
          "peak_backward_bytes", "output_bytes")


def _check_number(value: Any, what: str, *, integer: bool = False) -> None:
    """A cost is a finite number >= 0 (bytes: a whole one); anything else is a broken or edited record."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if ok and integer and value != int(value):
        ok = False
    if not ok:
        kind = "a whole number of bytes >= 0" if integer else "a finite number >= 0"
        raise RecordError(f"{what} is {value!r}, but must be {kind}; profile the model again rather than edit it.")


def _check_layers(layers: Sequence[LayerCost]) -> None:
    """Refuse impossible per-layer figures (a negative time, a NaN, fractional bytes) and a broken index."""
    for i, layer in enumerate(layers):
        where = f"layer {i} ({layer.name or 'unnamed'})"
        if layer.index != i:
            raise RecordError(f"{where} has index {layer.index}; layers must be numbered 0, 1, 2, ... in order.")
        for f in _TIMES:
            _check_number(getattr(layer, f), f"{where} {f}")
        # a gap is signed (a layer may be faster inside the model than alone); its time in the model is not
        for f, gap in (("forward_time", "forward_gap"), ("backward_time", "backward_gap")):
            if not isinstance(getattr(layer, gap), (int, float)) or not math.isfinite(getattr(layer, gap)):
                raise RecordError(f"{where} {gap} is {getattr(layer, gap)!r}, not a number of seconds; "
                                  "profile the model again rather than edit it.")
            _check_number(getattr(layer, f) + getattr(layer, gap), f"{where} {f} + {gap}")
        for f in _BYTES:
            _check_number(getattr(layer, f), f"{where} {f}", integer=True)
        for mode, rc in layer.recompute.items():
            if mode not in RECOMPUTE_MODES or mode == "none":
                raise RecordError(f"{where} has recompute mode {mode!r}; use one of selective, full.")
            _check_number(rc.activation_bytes, f"{where} recompute[{mode!r}].activation_bytes", integer=True)
            _check_number(rc.extra_backward_time, f"{where} recompute[{mode!r}].extra_backward_time")
        if not isinstance(layer.weight_hold_bytes, dict):
            raise RecordError(f"{where} weight_hold_bytes is {layer.weight_hold_bytes!r}, not a mode -> bytes mapping; "
                              "profile the model again rather than edit it.")
        for mode, nbytes in layer.weight_hold_bytes.items():
            if mode not in RECOMPUTE_MODES:
                raise RecordError(f"{where} has weight_hold_bytes for mode {mode!r}; use none, selective or full.")
            _check_number(nbytes, f"{where} weight_hold_bytes[{mode!r}]", integer=True)


def optimizer_state_factor(optimizer: str) -> float:
    """Bytes of optimizer state per byte of parameter (same dtype as the parameter)."""
    # adafactor: a matrix keeps a row and a column of second moments (rows + columns of its rows x
    # columns), a vector a whole one: 0.26% of GPT-2's parameters, 0.04% of Llama-7B's, 0.44% of
    # llama-tiny's; charged 1%, which holds down to matrices of width 200
    table = {"adam": 2.0, "adamw": 2.0, "sgd": 0.0, "sgd-momentum": 1.0, "adafactor": 0.01, "none": 0.0}
    try:
        return table[optimizer.lower()]
    except KeyError:
        raise RecordError(
            f"unknown optimizer {optimizer!r}; use one of {', '.join(sorted(table))}."
        ) from None
