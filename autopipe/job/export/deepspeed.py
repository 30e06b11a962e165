"""DeepSpeed: a Python file with the plan's module names per stage and the PipelineModule that takes them.

The file holds ``STAGE_MODULES`` (module FQNs per stage), ``LAYER_MODULES`` and ``PARTS`` (one
PipelineModule layer per flattened layer of autopipe, if you build your layers that way),
``DS_CONFIG`` (the batch sizes and ZeRO stage the plan assumed) and, copied from
autopipe.runtime.deepspeed_engine.parts, ``parts_for`` and ``planned_pipeline_module``: DeepSpeed's own
PipelineModule with explicit parts. It imports nothing from autopipe, so it can be copied into a
DeepSpeed project as it is.
"""

from __future__ import annotations

import inspect
import json

from ...runtime.deepspeed_engine import parts as ds_parts
from .modules import StageModules

__all__ = ["deepspeed_file", "deepspeed_config"]

MARK = "# ---- the wrapper"


def deepspeed_config(sm: StageModules) -> dict[str, object]:
    """The ds_config entries the plan fixes: micro-batch size and count, ZeRO stage."""
    return {
        "train_micro_batch_size_per_gpu": sm.microbatch_size,
        "gradient_accumulation_steps": sm.microbatches,
        "train_batch_size": sm.microbatch_size * sm.microbatches * sm.dp,
        "zero_optimization": {"stage": sm.zero if sm.dp > 1 else 0},
    }


def _wrapper_source() -> str:
    text = inspect.getsource(ds_parts)
    return text[text.index(MARK):]


def deepspeed_file(sm: StageModules) -> str:
    """The Python file ``autopipe export --to deepspeed`` writes."""
    layer_modules = [list(u) for u in sm.units]  # one PipelineModule layer per flattened layer
    parts = [a for a, _ in sm.layers] + [sm.layers[-1][1]]
    tied = "\n".join(f"#   {' = '.join(names)}: on stages {', '.join(map(str, chunks))}; give each stage's layer a "
                     f"TiedLayerSpec with one key" for names, chunks in sm.tied)  # fmt: skip
    checkpoint = ("activation_checkpoint_interval=1 (the plan recomputes every layer)" if sm.recompute == "full"
                  else "no activation checkpointing (the plan recomputes nothing)")  # fmt: skip
    stages = ",\n".join(f"    {json.dumps(list(m))}" for m in sm.modules)
    head = f'''"""DeepSpeed pipeline cut where autopipe's plan cuts: {sm.model or "the model"}, {sm.stages} stages.

Written by `autopipe export --to deepspeed`. Build your PipelineModule from the layers you already
have; name the module(s) each layer runs, and ``parts_for`` puts each layer on the plan's stage:

    from ds_pipeline import DS_CONFIG, NUM_STAGES, STAGE_MODULES, parts_for, planned_pipeline_module
    parts = parts_for(STAGE_MODULES, ["{sm.modules[0][0]}", ...])  # one entry per layer, None for a lambda
    net = planned_pipeline_module(layers, parts, num_stages=NUM_STAGES, loss_fn=loss_fn)

or, with one layer per entry of LAYER_MODULES: ``planned_pipeline_module(layers, PARTS, ...)``.
The plan: DeepSpeed's 1F1B schedule (TrainSchedule), {sm.microbatches} micro-batches of {sm.microbatch_size}
(gradient_accumulation_steps; DS_CONFIG), {checkpoint}; predicted step {sm.step_time * 1e3:.3f} ms.
"""
#
# Tied tensors (DeepSpeed all-reduces their gradients between the stages holding them):
{tied or "#   none"}

from __future__ import annotations

NUM_STAGES = {sm.stages}
STAGE_MODULES = [
{stages},
]
LAYER_MODULES = {json.dumps(layer_modules)}
PARTS = {parts}
DS_CONFIG = {json.dumps(deepspeed_config(sm))}

'''
    return head + _wrapper_source()
