"""Estimate mode: a layer's time from its FLOPs and bytes on meta tensors, by a roofline.

Nothing real runs: the layer is copied onto the meta device (no data), its forward and backward are
dispatched operator by operator, and each operator costs
``max(flops / (peak * efficiency), bytes / (bandwidth * efficiency)) + launch overhead``.
FLOPs come from torch.utils.flop_counter's formulas (matmuls, convolutions, attention); an operator
without a formula is memory-bound (elementwise, norms, softmax). This is how a 70B model is planned
on a laptop.

Recompute: ``full`` runs the whole forward again in backward, so its extra time is the forward's;
``selective`` runs again only the operators its policy does not keep (:data:`recompute.SAVED_OPS`),
so its extra time is the forward's minus those operators' roofline seconds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..graph.batch_free import making_value
from ..graph.recompute import SAVED_OPS
from .devices import DeviceSpec
from .measure import Value, backward_targets, grad_outputs, storage_key, tensor_bytes

__all__ = ["OpCost", "Estimate", "estimate_layer", "meta_copy", "data_free"]

# Operators that allocate without reading or writing memory worth counting.
_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias"}


class OpCost(TorchDispatchMode):
    """Sums FLOPs, bytes moved and roofline seconds of every operator dispatched while active."""

    def __init__(self, spec: DeviceSpec, dtype: str) -> None:
        super().__init__()
        self.peak = spec.peak_flops(dtype) * spec.compute_efficiency
        self.bandwidth = spec.memory_bandwidth * spec.memory_efficiency
        self.overhead = spec.op_overhead
        self.flops = 0.0
        self.bytes = 0
        self.seconds = 0.0
        self.kept_seconds = 0.0  # of operators whose outputs selective recompute keeps
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if making_value():  # a mask or rotary table a stage makes once, not per micro-batch
            return out
        packet = func.overloadpacket
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        # Views, reshapes that alias (_unsafe_view) and checks (_assert_tensor_metadata) run no kernel.
        if (func.is_view or packet.__name__ in _NO_TRAFFIC or not outs
                or (not func._schema.is_mutable and all(storage_key(o) in inputs for o in outs))):
            return out
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        moved = sum(tensor_bytes(t) for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, Tensor))
        self.flops += flops
        self.bytes += moved
        seconds = max(flops / self.peak, moved / self.bandwidth) + self.overhead
        self.seconds += seconds
        if packet in SAVED_OPS:
            self.kept_seconds += seconds
        self.ops += 1
        return out


@dataclass(frozen=True)
class Estimate:
    forward_time: float
    backward_time: float
    forward_flops: float
    backward_flops: float
    recompute_time: dict[str, float]  # mode -> seconds the recomputation adds to the backward


def estimate_layer(layer: nn.Module, x: Value, *, spec: DeviceSpec, dtype: str) -> Estimate:
    """Roofline forward and backward seconds of a meta-device layer on meta input ``x``."""
    with OpCost(spec, dtype) as fwd:
        out = layer(x)
    outs, grads = grad_outputs(out)
    targets = backward_targets(layer, x)
    bwd = OpCost(spec, dtype)
    if outs and targets:
        with bwd:
            torch.autograd.grad(outs, targets, grads, allow_unused=True)
    # a layer with nothing to differentiate has no backward, so nothing is recomputed
    recompute = {"full": fwd.seconds, "selective": fwd.seconds - fwd.kept_seconds} if outs and targets else {}
    return Estimate(fwd.seconds, bwd.seconds, fwd.flops, bwd.flops, recompute)


def data_free(t: Tensor, device: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """A stand-in for ``t`` with no data: on meta, or a fake tensor when a FakeTensorMode is active."""
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    if hasattr(t, "device_mesh"):  # a tensor-parallel DTensor: a plain stand-in of its global shape
        return torch.empty(t.shape, device=device, dtype=target).requires_grad_(t.requires_grad)
    return torch.empty_like(t.detach(), device=device, dtype=target).requires_grad_(t.requires_grad)


def meta_copy(layer: nn.Module, dtype: torch.dtype | None = None, device: torch.device | str = "meta") -> nn.Module:
    """A copy of ``layer`` whose every tensor (parameters, buffers, constants) holds no data.

    With ``device="meta"`` the copy lives on meta. A layer traced on a real device has that device
    baked into its graph (``arange(device=cpu)``), so it is copied onto its own device inside a
    FakeTensorMode instead: the tensors are fake there. The deepcopy memo is seeded with the
    stand-ins, so no real data is ever copied and the user's layer is left as it was.
    """
    device = torch.device(device)
    memo: dict[int, object] = {}
    for p in layer.parameters():
        memo[id(p)] = nn.Parameter(data_free(p, device, dtype), requires_grad=p.requires_grad)
    for b in layer.buffers():
        memo[id(b)] = data_free(b, device, dtype)
    for m in layer.modules():
        for v in vars(m).values():
            if isinstance(v, Tensor) and id(v) not in memo:
                memo[id(v)] = data_free(v, device, dtype)
    out = copy.deepcopy(layer, memo)
    for m in out.modules():  # a tensor-parallel layer's DTensor forward stays the original's: the copy is plain
        if getattr(m.__dict__.get("forward"), "autopipe_tp", False):
            del m.__dict__["forward"]
    return out
