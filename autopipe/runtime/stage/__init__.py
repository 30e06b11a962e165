"""This rank's stage: the model built on the meta device, flattened, cut by the plan, and only
this rank's chunks given real tensors (initialised per module, or loaded from safetensors).

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "MicrobatchSeeds": "build",
    "PipeChunk": "build",
    "StageBuild": "build",
    "TiedSpec": "build",
    "build_reference": "build",
    "build_stage": "build",
    "contiguous_grads": "build",
    "local": "build",
    "meta_model": "build",
    "traced_eval_mode": "eval_mode",
    "SafetensorsSource": "weights",
    "host_init": "weights",
    "init_weights_": "weights",
    "load_weights_": "weights",
    "materialize_": "weights",
    "module_seed": "weights",
    "tensor_names": "weights",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
