"""Export a plan to the engine people already run: what torchtitan, Megatron-Core and DeepSpeed read.

    modules     the plan as module names per stage, checked against the model; what cannot be expressed
    torchtitan  [parallelism] TOML (module_fqns_per_model_part, ...) and the command-line overrides
    megatron    --pipeline-model-parallel-layout and the flags it implies
    deepspeed   a Python file: module names per stage and DeepSpeed's PipelineModule with explicit parts
    fqns        JSON: module names per stage, for any other engine
    exporter    export_plan: the file, checked, with the plan's step beside the engine's default split

Plans meant for export are made with ``partition(..., target=...)`` (``autopipe plan --for``): only
the cuts the engine can make (autopipe.planner.targets).
"""

from __future__ import annotations

from .exporter import SUFFIXES, Export, default_plan, export_plan
from .modules import StageModules, stage_modules

__all__ = ["Export", "StageModules", "SUFFIXES", "default_plan", "export_plan", "stage_modules"]
