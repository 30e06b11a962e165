"""What tensor parallelism divides in one traced layer (its :class:`TpShape`), found on data-free tensors.

The layer's forward and backward are dispatched op by op (aten ops: a flattened layer is an fx graph
of them) on meta or fake tensors, and each op is priced by the estimate's roofline
(autopipe.costs.estimate). The sharded part is found by following the data, as Megatron-LM's
column/row pairs and torch's DTensor ``ColwiseParallel`` / ``RowwiseParallel`` shard it:

- a matmul (``mm``, ``addmm``, ``linear``, ``bmm``) with a parameter weight (or a cast or view of
  one) whose other input is replicated is *colwise*: its weight (and bias) sharded on the output
  features, its output sharded;
- an op with a sharded input has a sharded output (attention heads after q/k/v, the MLP's gate·up,
  rotary applied to sharded heads) and is divided by tp;
- a matmul with a parameter weight whose input is sharded is *rowwise*: its weight sharded on the
  input features, its output a partial sum all-reduced (replicated again);
- an ``embedding`` with a parameter table is vocab-sharded (HF's ``embedding_rowwise``): its
  output all-reduced;
- a colwise matmul none of whose sharded descendants reaches a rowwise one (an output layer's
  logits: HF's ``colwise_gather_output``) gathers its output whole: only the matmul divides.

A vocabulary the degree does not divide is taken as padded to a multiple of it (Megatron-LM's
``--make-vocab-size-divisible-by``), so it sets no divisor.

Seconds of the divided ops over all the layer's seconds are its split shares (forward; backward by
the same rules on the backward's ops, which start from the forward's sharded tensors: an input
gradient of a rowwise matmul is sharded, a colwise one's is a partial sum, the one all-reduce the
backward adds per distinct colwise input). Bytes kept for backward (saved-tensor hooks) are split
into sharded and replicated storages. The degree must divide every sharded feature count and the
attention heads seen by ``scaled_dot_product_attention`` (key/value heads after a repeat are not
seen: a GQA model's tp must also divide its key/value heads, which the searched degrees ≤ 8 do for
Llama 2/3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..graph.batch_free import making_value
from .devices import DeviceSpec
from .layer_costs import TpShape
from .measure import Value, as_tuple, backward_targets, grad_outputs, storage_key, tensor_bytes

__all__ = ["tp_shape"]

_MATMULS = {"mm", "addmm", "linear", "bmm", "matmul"}
_COPIES = {"_to_copy", "clone", "contiguous", "to", "_autocast_to_reduced_precision", "detach", "alias"}


@dataclass
class _Op:
    name: str
    ins: list[int]
    outs: list[int]
    seconds: float
    kind: str = "other"  # other | mm | emb
    x: int = 0  # the matmul's non-weight input (storage key)
    x_bytes: int = 0
    out_bytes: int = 0
    weight: int = 0  # the parameter's storage key
    bias: int = 0
    features: tuple[int, int] = (0, 0)  # (in, out) of a matmul's weight
    heads: tuple[int, ...] = ()
    split_heads: int = 0


@dataclass
class _Trace(TorchDispatchMode):
    spec: DeviceSpec
    dtype: str
    params: dict[int, int]  # parameter storage key -> bytes
    ops: list[_Op] = field(default_factory=list)
    keep: list[Tensor] = field(default_factory=list)  # alive, so no storage key is reused
    origin: dict[int, int] = field(default_factory=dict)  # weight-derived storage -> its parameter

    def __post_init__(self) -> None:
        super().__init__()
        self.peak = self.spec.peak_flops(self.dtype) * self.spec.compute_efficiency
        self.bandwidth = self.spec.memory_bandwidth * self.spec.memory_efficiency
        self.origin = {k: k for k in self.params}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if making_value():
            return out
        name = func.overloadpacket.__name__
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        self.keep += ins + outs
        ik, ok = [storage_key(t) for t in ins], [storage_key(t) for t in outs]
        if (name in _COPIES or func.is_view) and ik and ik[0] in self.origin:
            for k in ok:  # a cast or view of a weight is that weight
                self.origin.setdefault(k, self.origin[ik[0]])
        seconds = 0.0
        if not (func.is_view or not outs or (not func._schema.is_mutable and all(k in set(ik) for k in ok))):
            flops = float(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)) \
                if func.overloadpacket in flop_registry else 0.0
            moved = sum(tensor_bytes(t) for t in ins + outs)
            seconds = max(flops / self.peak, moved / self.bandwidth) + self.spec.op_overhead
        op = _Op(name, ik, ok, seconds, out_bytes=sum(tensor_bytes(t) for t in outs))
        if name in _MATMULS:
            w = [(t, k) for t, k in zip(ins, ik) if k in self.origin and t.dim() == 2]
            xs = [(t, k) for t, k in zip(ins, ik) if k not in self.origin and t.dim() >= 2]
            if w and xs:
                wt, wk = w[0]
                op.kind, op.weight, op.x, op.x_bytes = "mm", self.origin[wk], xs[0][1], tensor_bytes(xs[0][0])
                # linear's weight is (out, in); mm/addmm/bmm take it transposed, (in, out)
                op.features = (wt.shape[1], wt.shape[0]) if name == "linear" else (wt.shape[0], wt.shape[1])
                b = [k for t, k in zip(ins, ik) if k in self.origin and t.dim() == 1]
                op.bias = self.origin[b[0]] if b else 0
        elif name == "embedding" and ik and ik[0] in self.origin:
            op.kind, op.weight, op.features = "emb", self.origin[ik[0]], (ins[0].shape[0], ins[0].shape[1])
        elif "scaled_dot_product" in name and len(ins) >= 2 and ins[0].dim() == 4:
            op.heads = (ins[0].shape[1], ins[1].shape[1])
        elif func.is_view and ins and outs and ins[0].dim() == 3 and outs[0].dim() == 4:
            op.split_heads = outs[0].shape[2]  # (b, s, h) -> (b, s, heads, d): a candidate head split
        self.ops.append(op)
        return out


def _propagate(ops: list[_Op], start: set[int], gathered: set[int]) -> tuple[set[int], dict[int, str], set[int]]:
    """The sharded storages, each matmul's role, and the colwise ops some rowwise matmul pairs with."""
    sharded, role, paired = set(start), {}, set()
    origins: dict[int, set[int]] = {}
    for i, op in enumerate(ops):
        if op.kind == "mm":
            if op.x in sharded:
                role[i] = "row"
                paired |= origins.get(op.x, set())
                continue
            role[i] = "col"
            if i not in gathered:
                for k in op.outs:
                    sharded.add(k)
                    origins[k] = {i}
            continue
        if op.kind == "emb":
            role[i] = "emb"
            continue
        hit = [k for k in op.ins if k in sharded]
        if hit:
            role[i] = "split"
            mark = set().union(*(origins.get(k, set()) for k in hit))
            for k in op.outs:
                sharded.add(k)
                origins[k] = origins.get(k, set()) | mark
    return sharded, role, paired


def tp_shape(layer: nn.Module, x: Value, *, spec: DeviceSpec, dtype: str, whole: frozenset[str] = frozenset()) -> TpShape:
    """The TpShape of ``layer`` (on meta or fake tensors) on input ``x``; see the module docstring.
    ``whole``: names of parameters the runtime keeps whole (autopipe.graph.tp_plan.whole_weights: a
    derived plan's unpaired output matmul, a tied tensor whose layers disagree): their matmuls and
    lookups are not sharded here either."""
    params = {storage_key(p): tensor_bytes(p) for p in layer.parameters()}
    kept = {storage_key(p) for n, p in layer.named_parameters(remove_duplicate=False) if n in whole}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    fwd = _Trace(spec, dtype, params)
    with fwd, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    bwd = _Trace(spec, dtype, params)
    bwd.origin = dict(fwd.origin)
    outs, grads = grad_outputs(out)
    targets = backward_targets(layer, x)
    if outs and targets:
        with bwd:
            torch.autograd.grad(outs, targets, grads, allow_unused=True)
    ops = fwd.ops
    for op in (*fwd.ops, *bwd.ops):
        if op.kind in ("mm", "emb") and op.weight in kept:
            op.kind = "other"  # a replicated weight: an op like any other, sharded only by a sharded input
    gathered: set[int] = set()
    for _ in range(8):  # a colwise op no rowwise one pairs with gathers its output; until nothing changes
        sharded, role, paired = _propagate(ops, set(), gathered)
        more = {i for i, r in role.items() if r == "col" and i not in paired} - gathered
        if not more:
            break
        gathered |= more
    mms = [i for i, r in role.items() if r in ("col", "row", "emb")]
    seq_bytes = sum(tensor_bytes(t) for t in tree_flatten(out)[0]
                    if isinstance(t, Tensor) and t.is_floating_point() and t.dim() == 3)
    if not mms:
        return TpShape(source="traced", sequence_bytes=seq_bytes)
    total_f = sum(op.seconds for op in ops) or 1.0
    split_f = sum(op.seconds for i, op in enumerate(ops) if i in role) / total_f
    sharded_w = {ops[i].weight for i in mms} | {ops[i].bias for i in mms if role[i] == "col" and i not in gathered and ops[i].bias}
    all_params = sum(params.values()) or 1
    param_share = sum(params[k] for k in sharded_w if k in params) / all_params
    acts = {k: b for k, b in saved.items() if k not in fwd.origin}
    act_share = sum(b for k, b in acts.items() if k in sharded) / (sum(acts.values()) or 1)
    ar_fwd = tuple(ops[i].out_bytes for i in mms if role[i] in ("row", "emb"))
    col_inputs = {ops[i].x: ops[i].x_bytes for i in mms if role[i] == "col"}
    ar_bwd = tuple(col_inputs.values()) if outs and targets else ()
    gather = tuple(ops[i].out_bytes for i in sorted(gathered))
    # vocabularies (an embedding's rows, gathered logits) are left out: padded to a multiple of the
    # degree, as Megatron-LM pads them (--make-vocab-size-divisible-by)
    dims = [ops[i].features[1] for i in mms if role[i] == "col" and i not in gathered]
    dims += [ops[i].features[0] for i in mms if role[i] == "row"]
    dims += [h for op in ops for h in op.heads]
    dims += [op.split_heads for op in ops if op.split_heads and any(k in sharded for k in op.ins)]
    divisor = 0
    for d in dims:
        divisor = math.gcd(divisor, int(d))
    split_b = split_f
    if outs and targets and not gathered and any(r == "row" for r in role.values()):
        # the backward by the same rules, from the forward's sharded storages
        b_sharded, b_role, _ = _propagate(bwd.ops, sharded, set())
        total_b = sum(op.seconds for op in bwd.ops) or 1.0
        split_b = sum(op.seconds for i, op in enumerate(bwd.ops) if i in b_role) / total_b
    return TpShape(split_forward=split_f, split_backward=split_b, param_share=param_share, activation_share=act_share,
                   allreduce_forward=ar_fwd, allreduce_backward=ar_bwd, gather_forward=gather, divisor=divisor,
                   sequence_bytes=seq_bytes)  # fmt: skip


def layer_tp_shape(work: nn.Module, x: Value, *, spec: DeviceSpec, dtype: str, amp: Any = None,
                   whole: frozenset[str] = frozenset()) -> TpShape | None:  # fmt: skip
    """``tp_shape`` of a layer as the profiler holds it, or None where it cannot be traced data-free."""
    try:
        return tp_shape(work, x, spec=spec, dtype=dtype, whole=whole)
    except Exception:  # noqa: BLE001  (a layer that cannot be followed is priced replicated: no shape)
        return None


_ = as_tuple  # re-exported helper kept for callers that pass tuples
