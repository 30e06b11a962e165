"""Export a plan to the engine people already run: what torchtitan, Megatron-Core and DeepSpeed read.

    modules     the plan as module names per stage, checked against the model; what cannot be expressed
    titan_names which torchtitan release, and the names its splitter finds the plan's modules by
    torchtitan  0.3's config function module or 0.2's TOML, and the command-line overrides
    commands    the user's whole command per engine and what is left to do by hand
    megatron    --pipeline-model-parallel-layout and the flags it implies
    deepspeed   a Python file: module names per stage and DeepSpeed's PipelineModule with explicit parts
    fqns        JSON: module names per stage, for any other engine
    exporter    export_plan: the file, checked, with the plan's step beside the engine's default split

Plans meant for export are made with ``partition(..., target=...)`` (``autopipe plan --for``): only
the cuts the engine can make (autopipe.planner.targets).
"""

from __future__ import annotations

from .exporter import FILENAMES, SUFFIXES, Export, default_filename, default_plan, export_plan, split_target
from .modules import StageModules, stage_modules

__all__ = ["Export", "StageModules", "SUFFIXES", "FILENAMES", "default_filename", "default_plan", "export_plan",
           "split_target", "stage_modules"]
