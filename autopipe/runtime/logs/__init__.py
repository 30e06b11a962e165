"""What a run reports: the step record and its line on rank 0, the sinks (JSON lines,
TensorBoard, W&B), each rank's peak memory, and the FLOPs behind the MFU.

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "peak_flops": "flops",
    "step_flops": "flops",
    "world_peak_flops": "flops",
    "PeakDetail": "peak",
    "PeakMemory": "peak",
    "process_device_bytes": "peak",
    "resident_bytes": "peak",
    "JsonLines": "sinks",
    "TensorBoard": "sinks",
    "WandB": "sinks",
    "scalars": "sinks",
    "Predictions": "steps",
    "StepLogger": "steps",
    "StepStats": "steps",
    "format_eta": "steps",
    "predictions": "steps",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
