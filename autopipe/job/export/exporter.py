"""export_plan: a plan and its profile (and model) -> the file an engine reads, checked, with its prediction.

Beside the file it says what the plan predicts against the engine's own default split of the same
model on the same pipeline (autopipe.planner.targets.default_cut), from the same simulator.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...costs.layer_costs import Profile
from ...errors import AutopipeError, ExportError, InfeasibleMemoryError
from ...planner.partitioner import partition
from ...planner.plan import Plan
from ...planner.targets import default_cut, target_info
from .commands import Command, check_titan_path, deepspeed_command, megatron_command, titan_command
from .deepspeed import deepspeed_file
from .fqns import fqns_json
from .megatron import megatron_args
from .modules import StageModules, stage_modules
from .titan_names import titan_parts, titan_version
from .torchtitan import titan_job, torchtitan_module, torchtitan_overrides, torchtitan_toml

__all__ = ["Export", "export_plan", "default_plan", "default_filename", "split_target", "SUFFIXES", "FILENAMES"]

SUFFIXES = {"torchtitan": ".py", "megatron": ".sh", "deepspeed": ".py", "fqns": ".json"}  # torchtitan@0.2: .toml
FILENAMES = {"torchtitan": "autopipe_plan.py", "megatron": "pipeline_args.sh", "deepspeed": "ds_pipeline.py",
             "fqns": "stage_modules.json"}  # fmt: skip


@dataclass(frozen=True)
class Export:
    """What ``autopipe export`` writes: the file's text and its usual name, the same as command-line
    overrides where the engine takes them (torchtitan), the command that runs it and what the user
    still does by hand, and the plan's step beside the engine's default split."""

    target: str
    text: str
    suffix: str
    modules: StageModules
    overrides: str = ""
    step_time: float = 0.0
    default_step_time: float | None = None  # the engine's own split, same pipeline; None: not comparable
    default_name: str = ""
    default_over_limit: bool = False  # the default split does not fit the plan's memory limit
    filename: str = ""  # the name the command expects when no path is given
    version: str = ""  # the engine release written for (torchtitan: "0.3.0", "0.2")
    args: tuple[str, ...] = ()  # ``overrides`` as argv tokens (torchtitan), as its parser takes them
    command: str = ""
    todo: tuple[str, ...] = ()


def default_filename(target: str) -> str:
    """The file name an export of ``target`` goes by (torchtitan's suffix is its release's form)."""
    key, asked = split_target(target)
    if key == "torchtitan":
        return "autopipe_plan" + (".toml" if titan_version(asked).toml else ".py")
    return FILENAMES[key]


def split_target(target: str) -> tuple[str, str | None]:
    """``torchtitan@0.2`` -> ("torchtitan", "0.2"); a version on any other target is one line.

    >>> split_target("torchtitan@0.2"), split_target("megatron")
    (('torchtitan', '0.2'), ('megatron', None))
    """
    key, at, version = str(target).partition("@")
    t = target_info(key)
    if at and t.key != "torchtitan":
        raise ExportError(f"only torchtitan takes a version (torchtitan@0.2 or @0.3); {t.name} has one form: --to {t.key}.")
    if at and not version.strip():
        raise ExportError("torchtitan@ needs a version after it: torchtitan@0.2 (TOML) or torchtitan@0.3 (config function).")
    return t.key, (version.strip() or None) if at else None


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


def export_plan(plan: Plan, profile: Profile, target: str, *, model: Any = None, path: str | Path | None = None) -> Export:
    """Write ``plan`` for ``target``: torchtitan (the installed release's form, else 0.3's;
    ``torchtitan@0.2`` for 0.2's TOML), megatron, deepspeed or fqns.

    ``profile`` is the one the plan was made from (its layer names); ``model``, optional and on any device
    (meta is enough), checks those names against the model's modules; ``path`` is where the file will be
    (the command names it; default ``Export.filename``). Raises ExportError (one line: what the engine
    cannot express and what would work) for a plan it cannot run.

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
    key, asked = split_target(target)
    sm = stage_modules(plan, profile, key, model)
    version, args, todo = "", (), ()
    suffix = SUFFIXES[key]
    if key == "torchtitan":
        v = titan_version(asked)
        suffix = ".toml" if v.toml else ".py"
        where = Path(path) if path is not None else Path("autopipe_plan" + suffix)
        check_titan_path(where, v)
        parts = titan_parts(sm.modules, v)
        job = titan_job(profile.model, parts)
        text = torchtitan_toml(sm, parts, v, job) if v.toml else torchtitan_module(sm, parts, v, job)
        args = tuple(torchtitan_overrides(sm, parts, v))
        cmd = titan_command(sm, v, job, where, list(args), parts.backend)
        version = v.release
    elif key == "megatron":
        where = Path(path or FILENAMES[key])
        head = (f"# autopipe plan for {sm.model or 'the model'}: Megatron-Core's flags; predicted step "
                f"{sm.step_time * 1e3:.3f} ms.\n# Pass them to pretrain_gpt.py: \"${{PIPELINE_ARGS[@]}}\"\n")
        text = head + "PIPELINE_ARGS=(\n" + "".join(f"  {f}\n" for f in megatron_args(sm)) + ")\n"
        cmd = megatron_command(sm, where, getattr(model, "config", None))
    elif key == "deepspeed":
        where = Path(path or FILENAMES[key])
        text, cmd = deepspeed_file(sm), deepspeed_command(sm, where)
    else:
        where = Path(path or FILENAMES[key])
        text, cmd = fqns_json(sm), Command("")
    other, what = default_plan(plan, profile, key)
    over = other is not None and plan.memory_limit is not None and other.peak_memory > plan.memory_limit
    overrides = " \\\n  ".join(_pairs(list(args))) + "\n" if args else ""
    return Export(key, text, suffix, sm, overrides, plan.step_time, None if other is None else other.step_time, what,
                  over, where.name, version, args, cmd.command, cmd.todo)  # fmt: skip


def _pairs(args: list[str]) -> list[str]:
    """argv tokens grouped one flag (with its values) per line, for showing."""
    out: list[str] = []
    for a in args:
        if a.startswith("--") or not out or ":" in a:
            out.append(a)
        else:
            out[-1] += " " + a
    return out
