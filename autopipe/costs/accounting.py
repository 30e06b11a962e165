"""Bytes, charged once each: what a layer keeps for backward (a ledger per recompute mode), what its
parameters, gradients and optimizer state take, and the 16-bit weight copies autocast keeps."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..choices import RECOMPUTE_MODES
from .layer_costs import LayerCost, RecomputeCost
from .measure import Value, as_tuple, storage_key

__all__ = ["Ledger", "ParamSizer", "layer_cost", "tied_bytes", "autocast_weight_bytes"]

_COUNTED = -1  # ledger mark: this storage's bytes are already charged to some layer

# matmul-like operators autocast runs in 16 bits, casting their weight arguments (and keeping the copy)
_LOW_PRECISION_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution", "addbmm",
                      "conv1d", "conv2d", "conv3d"}  # fmt: skip


class Ledger:
    """Activation bytes per layer under one recompute mode: each kept storage is charged once, to the
    layer that produced it (the model's inputs to layer 0).

    So a run of layers sums to what they keep, each storage once, however many layers keep it: under
    ``full`` a layer keeps its input, which its producer pays for, and a chunk's sum is what its stage
    keeps for backward besides its input tuple (its output tuple included: the stage holds it anyway).
    """

    def __init__(self, num_layers: int, first_input: Sequence[Tensor]) -> None:
        self.bytes = [0] * num_layers
        # storage key of each tensor of the current input -> layer to charge if a layer keeps it
        self.owner = {storage_key(t): 0 for t in first_input}

    def charge(self, i: int, saved: Mapping[int, int], inputs: set[int], out: Value, own_out: Value) -> None:
        """Charge what layer ``i`` kept (``saved``); ``out`` feeds the next layer, ``own_out`` is the
        same output from the pass that kept ``saved`` (the same storages, or a recompute mode's run)."""
        for key, nbytes in saved.items():
            if key in inputs:
                if self.owner.get(key, _COUNTED) != _COUNTED:
                    self.bytes[self.owner[key]] += nbytes
                    self.owner[key] = _COUNTED
            else:
                self.bytes[i] += nbytes
        # Who pays for each storage of the output if a later layer keeps it: a storage passed through
        # unchanged keeps its producer; one layer i kept itself is paid for; a new one is i's.
        self.owner = {
            storage_key(t): (self.owner.get(storage_key(t), _COUNTED) if storage_key(t) in inputs
                             else _COUNTED if storage_key(own) in saved else i)
            for t, own in zip(as_tuple(out), as_tuple(own_out))
        }


def layer_cost(c: dict[str, Any], ledgers: Mapping[str, Ledger]) -> LayerCost:
    """A LayerCost from the figures timed for layer ``c['index']`` and the bytes its ledgers charged it."""
    i = c["index"]
    extra = c.pop("recompute_time", {})
    change = c.pop("hold_change", {})
    recompute = {
        mode: RecomputeCost(activation_bytes=ledgers[mode].bytes[i], extra_backward_time=extra.get(mode, 0.0))
        for mode in RECOMPUTE_MODES[1:]
    }
    # on the same ledger as the activations: what the layer keeps, plus what waiting for W changes
    hold = {mode: max(0, ledgers[mode].bytes[i] + d) for mode, d in change.items()}
    return LayerCost(activation_bytes=ledgers["none"].bytes[i], recompute=recompute, weight_hold_bytes=hold, **c)


class ParamSizer:
    """Parameter, gradient and optimizer-state bytes of one parameter under the chosen training setup."""

    def __init__(self, dtype: torch.dtype | None, mixed: bool, state_factor: float) -> None:
        self.dtype, self.mixed, self.state_factor = dtype, mixed, state_factor

    def __call__(self, p: Tensor) -> tuple[int, int, int]:
        n = p.numel()
        size = _element_size(self.dtype) if self.dtype is not None and p.is_floating_point() else p.element_size()
        if not p.requires_grad:
            return n * size, 0, 0
        if self.mixed and p.is_floating_point():
            # fp32 master copy plus fp32 optimizer state: what mixed-precision training keeps.
            return n * size, n * size, int(n * 4 * (1 + self.state_factor))
        return n * size, n * size, int(n * size * self.state_factor)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def tied_bytes(seq: Any, layers: list[nn.Module], sizes: ParamSizer) -> dict[str, int]:
    out: dict[str, int] = {}
    for group in getattr(seq, "tied", []) or []:
        names = set(group.names)
        for li in group.layers:
            found = [p for n, p in layers[li].named_parameters(remove_duplicate=False) if n in names]
            if found:
                out[group.canonical] = sum(sizes(found[0]))
                break
    return out


def autocast_weight_bytes(layer: nn.Module, x: Value, amp: torch.dtype) -> int:
    """Bytes of the 16-bit weight copies autocast would keep for one micro-batch of ``layer``: each
    weight matrix (or kernel) a matmul-like operator reads, once. Biases are cast too, but backward
    does not need them, so nothing keeps their copy."""
    params = {storage_key(p): p.numel() for p in layer.parameters() if p.is_floating_point() and p.dim() >= 2}
    used: set[int] = set()

    class _Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            if func.overloadpacket.__name__ in _LOW_PRECISION_OPS:
                used.update(k for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
                            and (k := storage_key(t)) in params)  # fmt: skip
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), _Reads():
        layer(x)
    return sum(params[k] for k in used) * torch.empty((), dtype=amp).element_size()
