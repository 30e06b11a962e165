"""The model's FLOPs per step and the devices' peak: what the progress line's MFU divides.

``step_flops`` counts the forward FLOPs of one micro-batch with ``torch.utils.flop_counter``, running
data-free copies of the flattened layers (fake tensors: no memory, no data, well under a second for
a GPT-2, whatever stage this rank holds), and takes three times that for forward and backward
(the usual "model FLOPs": recompute is not counted, so MFU does not reward it), for every
micro-batch and replica of the step. Under ``--ep`` an experts call runs no rows without data, so
its FLOPs come from its shapes (``costs.moe_shape.expert_flops``: 2 per expert weight per routed
slot). ``peak_flops`` is the device's published dense peak in the training precision, for GPUs
autopipe knows (A100, H100, H200); elsewhere None, and the line shows the model FLOP/s instead of a
utilisation.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["flop_counter", "peak_flops", "step_flops", "world_peak_flops"]


def step_flops(seq: Any, source: Any, *, microbatches: int, replicas: int = 1) -> float | None:
    """Forward + backward FLOPs of one training step (3x the forward of ``source``'s example
    micro-batch through the layers of ``seq``, counted without data), or None when they cannot be
    counted."""
    try:
        x: Any = tuple(torch.empty_like(t, device="meta") for t in seq.pack_inputs(source.args, source.kwargs))
        forward = 0.0
        for layer in seq.layers:
            flops, x = _layer_flops(layer, x)
            forward += flops
    except Exception:  # an operator neither meta nor fake tensors run only leaves the MFU out
        return None
    return 3 * forward * microbatches * replicas if forward > 0 else None


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """``aten._grouped_mm``'s FLOPs from its shapes (transformers' default experts implementation;
    torch's FlopCounterMode has no formula for it and counted the experts as 0): 2 per output
    element per term of its contraction, the contraction the inner size ``a_shape[-1]``, which a
    2-D × 2-D call (groups along K) shares out over its G outputs."""
    k = a_shape[-1]
    elements = 1
    for n in out_shape:
        elements *= n
    groups = out_shape[0] if len(a_shape) == 2 and len(b_shape) == 2 else 1
    return 2 * elements * k // groups


def flop_counter() -> Any:
    """torch's FlopCounterMode, quiet, that also counts ``aten._grouped_mm`` and transformers'
    ``grouped_mm_fallback`` (the experts' matmuls)."""
    from torch.utils.flop_counter import FlopCounterMode

    mapping: dict[Any, Any] = {torch.ops.aten._grouped_mm: _grouped_mm_flops}
    try:  # transformers' CPU stand-in for it (an opaque custom op, registered once transformers' MoE code loads)
        mapping[torch.ops.transformers.grouped_mm_fallback] = _grouped_mm_flops  # counters key by packet
    except (AttributeError, RuntimeError):
        pass
    return FlopCounterMode(display=False, custom_mapping=mapping)


def _layer_flops(layer: Any, x: Any) -> tuple[float, Any]:
    """One layer's forward FLOPs on input ``x`` (meta tensors), and its output (meta tensors).

    A rank holds its own stage's layers on its device (their graphs retargeted there) and the
    others' on meta (a tied tensor's copy may be real in a graph that names meta). So the layer is
    run as a data-free copy on meta, and where its graph names a real device, on fake tensors of
    that device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ...costs.estimate import meta_copy
    from ...graph.sequence import retarget_device_
    from ...costs.moe_shape import counting_expert_flops

    real = next((t.device for t in (*layer.parameters(), *layer.buffers()) if not t.is_meta), None)
    devices = [torch.device("meta"), real or torch.device("cuda" if torch.cuda.is_available() else "cpu")]
    for i, device in enumerate(devices):
        counter = flop_counter()
        try:  # under --ep the experts run no rows in a data-free pass: their FLOPs are tallied apart
            with torch.no_grad(), counting_expert_flops() as experts:
                if device.type == "meta":
                    with counter:
                        out = meta_copy(layer, device="meta")(x)
                else:
                    with FakeTensorMode(allow_non_fake_inputs=True):
                        fake = tuple(torch.empty_like(t, device=device) for t in x)
                        copy = meta_copy(layer, device=device)
                        # another stage's layer keeps the meta of its trace in some ops (a MoE router's
                        # arange) and this device in others (rotary's cast): the copy names this device
                        retarget_device_(copy, device, constants=False)
                        with counter:
                            out = copy(fake)
        except Exception:
            if i + 1 == len(devices):
                raise
            continue
        outs = out if isinstance(out, tuple) else (out,)
        meta = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in outs)
        return float(counter.get_total_flops()) + experts[0], meta if isinstance(out, tuple) else meta[0]
    raise AssertionError("unreachable")


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """Dense peak FLOP/s of ``device`` for training in ``dtype`` (fp32 | bf16 | fp16), or None."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    from ...costs.devices import KNOWN_DEVICES

    name = torch.cuda.get_device_name(device).lower()
    for key, spec in KNOWN_DEVICES.items():
        if key in name:
            return spec.peak_flops({"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    return None


def world_peak_flops(env: Any, dtype: str) -> float | None:
    """The whole world's peak FLOP/s (its ranks' devices together), or None when unknown."""
    one = peak_flops(env.device, dtype)
    return one * int(env.world) if one else None
