"""autopipe: trace, flatten, profile and auto-partition PyTorch models for pipeline parallelism.

    import autopipe
    seq = autopipe.flatten(model, example_args, example_kwargs)   # LayerSequence
    prof = autopipe.profile(seq, example_args, example_kwargs)    # Profile
    plan = autopipe.partition(prof, stages=4)                     # Plan
    stages = seq.split(plan)                                      # one nn.Module per stage
    pipe = autopipe.pipeline("my_model.py:build", "plan.json")    # this rank's, for a loop of your own

One folder per pass, each importing only the folders beneath it:

    cli/      the typer commands
    job/      convert (every pass in a row) and emit (the job folder, train.py)
    report/   report.html, its SVG kit, the rich tables
    cluster/  the layout search over N devices (torch-free)
    runtime/  what a generated train.py calls
    planner/  partition: the Plan, schedules and their simulator, the step solver (torch-free)
    costs/    profile: measuring and estimating each layer; the Profile record (torch-free)
    graph/    model sources, trace, flatten, the LayerSequence, recompute

The names below are imported on first use: ``import autopipe`` loads no torch.
"""

from __future__ import annotations

from .errors import AutopipeError
from .lazy import lazy_exports

__version__ = "0.1.0"

_NAMES = {
    "flatten": "graph.flattener",
    "LayerSequence": "graph.sequence",
    "profile": "costs.profiler",
    "Profile": "costs.layer_costs",
    "LayerCost": "costs.layer_costs",
    "DeviceInfo": "costs.layer_costs",
    "partition": "planner.partitioner",
    "Plan": "planner.plan",
    "pipeline": "runtime.api.pipeline",
    "Pipeline": "runtime.api.pipeline",
}
__getattr__ = lazy_exports(__name__, _NAMES, globals())

__all__ = ["AutopipeError", "DeviceInfo", "LayerCost", "LayerSequence", "Pipeline", "Plan", "Profile",
           "flatten", "partition", "pipeline", "profile"]
