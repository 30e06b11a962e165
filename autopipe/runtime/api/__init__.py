"""A training loop of your own: ``pipeline(model, plan)`` gives this rank its ``Pipeline`` (its
chunks on its device, the schedule, the optimizer over its parameters, the tied-gradient sync).

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "Pipeline": "pipeline",
    "pipeline": "pipeline",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
