"""autopipe: trace, flatten, profile and auto-partition PyTorch models for pipeline parallelism.

    import autopipe
    seq = autopipe.flatten(model, example_args, example_kwargs)   # LayerSequence
    prof = autopipe.profile(seq, example_args, example_kwargs)    # Profile
    plan = autopipe.partition(prof, stages=4)                     # Plan
    stages = seq.split(plan)                                      # one nn.Module per stage
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .errors import AutopipeError
from .records import DeviceInfo, LayerCost, Profile

__version__ = "0.1.0"

# Passes are imported on first use: `import autopipe` stays cheap for the CLI and for workers.
_LAZY = {
    "flatten": ("autopipe.flatten", "flatten"),
    "LayerSequence": ("autopipe.flatten", "LayerSequence"),
    "profile": ("autopipe.profile", "profile"),
    "partition": ("autopipe.partition", "partition"),
    "Plan": ("autopipe.plan", "Plan"),
}

__all__ = ["AutopipeError", "DeviceInfo", "LayerCost", "Profile", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'autopipe' has no attribute {name!r}") from None
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value
