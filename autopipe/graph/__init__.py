"""The model as a pipeline sees it: where models come from, the trace, the flattened layer sequence.

    sources      load_model: a built-in name, a HuggingFace folder or a factory -> model + example inputs
    tracer       trace: torch.export (non-strict) of the model with its example inputs
    cut_policy   which graph node belongs to which layer (policy)
    flattener    flatten: graph -> LayerSequence, values live across each cut packed in a tuple (mechanism)
    sequence     LayerSequence and its stage modules
    recompute    activation recompute per layer: none, selective, full
    rng          the random state of every device a computation draws from (CPU and each accelerator)
"""

from __future__ import annotations

from ..lazy import lazy_exports

_NAMES = {
    "load_model": "sources",
    "ModelSpec": "sources",
    "builtin_names": "sources",
    "trace": "tracer",
    "flatten": "flattener",
    "LayerSequence": "sequence",
    "Stage": "sequence",
    "TensorSig": "sequence",
    "LayerInfo": "sequence",
    "TiedGroup": "sequence",
    "run_layer": "recompute",
}
__getattr__ = lazy_exports(__name__, _NAMES, globals())
__all__ = list(_NAMES)
