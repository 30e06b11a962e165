"""What a job is checked against: the untouched model (``--verify``), plain single-process
training of the same layers, and the runtime reserve probe (what a rank holds beyond its tensors).

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "ReferenceTrainer": "reference",
    "SequenceModel": "reference",
    "unique_parameters": "reference",
    "holds_gpu_memory": "reserve",
    "measure_reserve": "reserve",
    "probe_config": "reserve",
    "reserve_for": "reserve",
    "runtime_reserve": "reserve",
    "seeded_like_pipeline": "untouched",
    "untouched_model": "untouched",
    "VerifyError": "verify",
    "VerifyReport": "verify",
    "verify_step": "verify",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
