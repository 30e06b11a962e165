"""export_plan: a plan and its profile (and model) -> the file an engine reads, checked, with its prediction.

Beside the file it says what the plan predicts against the engine's own default split of the same
model on the same pipeline (autopipe.planner.targets.default_cut), from the same simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...costs.layer_costs import Profile
from ...errors import AutopipeError, InfeasibleMemoryError
from ...planner.partitioner import partition
from ...planner.plan import Plan
from ...planner.targets import default_cut, target_info
from .deepspeed import deepspeed_file
from .fqns import fqns_json
from .megatron import megatron_args
from .modules import StageModules, stage_modules
from .torchtitan import torchtitan_overrides, torchtitan_toml

__all__ = ["Export", "export_plan", "default_plan", "SUFFIXES"]

SUFFIXES = {"torchtitan": ".toml", "megatron": ".sh", "deepspeed": ".py", "fqns": ".json"}


@dataclass(frozen=True)
class Export:
    """What ``autopipe export`` writes: the file's text, its usual suffix, a second form (torchtitan's
    command-line overrides), and the plan's step beside the engine's default split."""

    target: str
    text: str
    suffix: str
    modules: StageModules
    overrides: str = ""
    step_time: float = 0.0
    default_step_time: float | None = None  # the engine's own split, same pipeline; None: not comparable
    default_name: str = ""
    default_over_limit: bool = False  # the default split does not fit the plan's memory limit


def default_plan(plan: Plan, profile: Profile, target: str) -> tuple[Plan | None, str]:
    """The engine's default split priced like the plan (same stages, schedule, micro-batches, recompute
    policy as the engine runs it, ...): under the plan's memory limit, or, where it does not fit there,
    without one (its ``peak_memory`` then says by how much it is over); None where the engine has none
    for this model."""
    names = [layer.name or f"layer{i}" for i, layer in enumerate(profile.layers)]
    bandwidth = None if plan.bandwidth == float("inf") else plan.bandwidth
    try:
        bounds, what = default_cut(target, names, [float(layer.params) for layer in profile.layers], plan.num_chunks)
    except AutopipeError:
        return None, ""
    for limit in (plan.memory_limit, None):
        try:
            return partition(profile, plan.stages, microbatches=plan.microbatches, schedule=plan.schedule,
                             memory_limit=limit, virtual_stages=plan.virtual_stages, bandwidth=bandwidth,
                             boundaries=bounds, weight_share=plan.weight_share, optimizer=plan.optimizer,
                             recompute=plan.recompute, dp=plan.dp, zero=plan.zero, target=target), what  # fmt: skip
        except InfeasibleMemoryError:
            continue
        except AutopipeError:
            break
    return None, ""


def export_plan(plan: Plan, profile: Profile, target: str, *, model: Any = None) -> Export:
    """Write ``plan`` for ``target`` (torchtitan, megatron, deepspeed or fqns).

    ``profile`` is the one the plan was made from (its layer names); ``model``, optional and on any device
    (meta is enough), checks those names against the model's modules. Raises ExportError (one line:
    what the engine cannot express and what would work) for a plan it cannot run.

    Example:
        >>> from autopipe import Profile, partition
        >>> from autopipe.costs.layer_costs import LayerCost
        >>> names = ["embed", "layers.0", "layers.1", "layers.2", "norm", "head"]
        >>> prof = Profile(layers=tuple(LayerCost(i, n, 1.0, 2.0, params=10) for i, n in enumerate(names)))
        >>> plan = partition(prof, 2, target="megatron", bandwidth=None)
        >>> out = export_plan(plan, prof, "megatron")
        >>> [line.strip() for line in out.text.splitlines() if "layout" in line]
        ['--pipeline-model-parallel-layout "Et*2|t,L"']
    """
    t = target_info(target)
    sm = stage_modules(plan, profile, t.key, model)
    if t.key == "torchtitan":
        text, overrides = torchtitan_toml(sm), torchtitan_overrides(sm)
    elif t.key == "megatron":
        head = (f"# autopipe plan for {sm.model or 'the model'}: Megatron-Core's flags; predicted step "
                f"{sm.step_time * 1e3:.3f} ms.\n# Pass them to pretrain_gpt.py: \"${{PIPELINE_ARGS[@]}}\"\n")
        text, overrides = head + "PIPELINE_ARGS=(\n" + "".join(f"  {f}\n" for f in megatron_args(sm)) + ")\n", ""
    elif t.key == "deepspeed":
        text, overrides = deepspeed_file(sm), ""
    else:
        text, overrides = fqns_json(sm), ""
    other, what = default_plan(plan, profile, t.key)
    over = other is not None and plan.memory_limit is not None and other.peak_memory > plan.memory_limit
    return Export(t.key, text, SUFFIXES[t.key], sm, overrides, plan.step_time,
                  None if other is None else other.step_time, what, over)
