"""autopipe: trace, flatten, profile and auto-partition PyTorch models for pipeline parallelism.

    import autopipe
    seq = autopipe.flatten(model, example_args, example_kwargs)   # LayerSequence
    prof = autopipe.profile(seq, example_args, example_kwargs)    # Profile
    plan = autopipe.partition(prof, stages=4)                     # Plan
    stages = seq.split(plan)                                      # one nn.Module per stage
"""

from __future__ import annotations

from .errors import AutopipeError
from .records import DeviceInfo, LayerCost, Profile

__version__ = "0.1.0"

# The passes share names with their modules (autopipe.flatten is a function and a module). Importing
# the functions here binds the package attributes to them once; a later `import autopipe.flatten`
# finds the module already loaded and leaves the attribute alone.
from .flatten import flatten
from .partition import partition
from .plan import Plan
from .profile import profile
from .sequence import LayerSequence

__all__ = ["AutopipeError", "DeviceInfo", "LayerCost", "LayerSequence", "Plan", "Profile",
           "flatten", "partition", "profile"]
