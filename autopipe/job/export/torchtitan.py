"""torchtitan: the plan as the config the target release reads, its command-line overrides, and the command.

- torchtitan 0.3 reads no TOML: a job is a Python function returning ``Trainer.Config``, named by
  ``--module M --config F`` and overridden on the command line (``--parallelism.x v``; each model
  part one comma-joined token after ``--parallelism.module_fqns_per_model_part``; the recompute mode a
  subcommand, ``activation-checkpoint:{none,selective,full}``, after every flag). The export writes
  such a module (its function starts from the model's own config function) and prints the overrides
  that give the same on top of the user's own ``--module/--config``.
- torchtitan 0.2 reads TOML (``--job.config_file``): ``[parallelism]``, ``[training] local_batch_size``,
  ``[activation_checkpoint] mode``.

Both ways the recompute mode is written even when it is "none": torchtitan's default is "selective",
so a config without it would recompute what the plan did not price. The micro-batch count is
``training.local_batch_size / pipeline_parallel_microbatch_size`` in both releases. Data parallelism is
``data_parallel_replicate_degree`` (ZeRO 0) or ``data_parallel_shard_degree`` (FSDP2: ZeRO 3, or 2 with
``fsdp_reshard_after_forward = "never"``). Expert parallelism is ``expert_parallel_degree`` (written
where ep > 1; torchtitan borrows its ranks from dp_shard, so such a plan must shard: ZeRO 2/3, tp 1). Tensor parallelism is ``tensor_parallel_degree`` (the plan's
tp, always written) and, where tp > 1, ``enable_sequence_parallel`` as the plan priced it (torchtitan's
default is on).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ...graph.titan_models import is_titan_spec, parse_titan_spec
from ...planner.targets import TARGETS
from .modules import StageModules
from .titan_names import HF_BACKEND, TitanParts, TitanVersion

__all__ = ["TitanJob", "titan_job", "torchtitan_settings", "torchtitan_toml", "torchtitan_module",
           "torchtitan_overrides", "FUNCTION"]

FUNCTION = "autopipe_plan"  # the config function the 0.3 module defines (--config autopipe_plan)
_AC_03 = {"none": "None", "full": "FullAC.Config()", "selective": "SelectiveAC.Config()"}


@dataclass(frozen=True)
class TitanJob:
    """How torchtitan builds the model the plan is for ("" where autopipe cannot tell)."""

    module: str  # 0.3's --module / 0.2's [model] name: "llama3", "transformers_modeling_backend"
    flavor: str  # 0.2's [model] flavor
    config_fn: str  # 0.3's config function, "package.module:function"
    fields: tuple[tuple[str, object], ...] = ()  # model config fields the plan's model sets
    hf_model: str = ""  # the HuggingFace backend's model: the folder the plan's model came from


def _registry_function(module: str, flavor: str) -> str:
    """torchtitan's config function for a registry model (llama3 8B -> llama3_8b), if the installed
    torchtitan has it; found by reading its source (importing config_registry takes seconds)."""
    from importlib.util import find_spec

    spec = find_spec("torchtitan")
    name = f"{module}_{re.sub(r'[.-]', '_', flavor.lower())}"
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(list(spec.submodule_search_locations)[0]) / "models" / module / "config_registry.py"
    found = path.is_file() and re.search(rf"^def {re.escape(name)}\(", path.read_text(), re.M)
    return f"torchtitan.models.{module}.config_registry:{name}" if found else ""


def titan_job(model: str, parts: TitanParts) -> TitanJob:
    """How torchtitan builds ``model`` (the profile's model spec) split as ``parts`` say."""
    if parts.backend == "hf":
        folder = str(Path(model).resolve()) if model and Path(model).is_dir() else ""
        return TitanJob(HF_BACKEND, "full", f"torchtitan.experiments.{HF_BACKEND}.config_registry:{HF_BACKEND}_full",
                        hf_model=folder)  # fmt: skip
    if is_titan_spec(model):
        tm = parse_titan_spec(model)
        return TitanJob(tm.module, tm.flavor, _registry_function(tm.module, tm.flavor), tm.fields)
    return TitanJob("", "", "")


def torchtitan_settings(sm: StageModules, parts: TitanParts, v: TitanVersion) -> dict[str, dict[str, object]]:
    """Section -> field -> value in torchtitan's names; the recompute mode as 0.2's ``mode`` string."""
    parallelism: dict[str, object] = {
        "pipeline_parallel_degree": sm.stages,
        "pipeline_parallel_schedule": TARGETS["torchtitan"].schedule_name(sm.schedule),
        "pipeline_parallel_microbatch_size": sm.microbatch_size,
        "data_parallel_replicate_degree": sm.dp if sm.zero == 0 else 1,
        "data_parallel_shard_degree": sm.dp if sm.zero in (2, 3) else 1,
        "tensor_parallel_degree": sm.tp,
    }
    if sm.ep > 1:  # the experts sharded over ep of the dp_shard ranks (efsdp = dp_shard / ep)
        parallelism["expert_parallel_degree"] = sm.ep
    if sm.tp > 1:  # torchtitan's default is sequence parallel on; the plan priced one or the other
        parallelism["enable_sequence_parallel"] = sm.sequence_parallel
    if sm.dp > 1 and sm.zero == 2:  # FSDP2 keeping the parameters gathered between forward and backward
        parallelism["fsdp_reshard_after_forward"] = "never"
    parallelism["module_fqns_per_model_part"] = [list(p) for p in parts.parts]
    training: dict[str, object] = {"local_batch_size": sm.microbatch_size * sm.microbatches}
    if sm.seq_len:  # the plan's memory and times are for this many tokens per sample
        training["seq_len"] = sm.seq_len
    if not v.toml:  # 0.3 refuses CUDA graphs under pipeline parallelism unless told not to capture them
        training["disable_cuda_graphs"] = True
    return {"parallelism": parallelism, "training": training, "activation_checkpoint": {"mode": sm.recompute}}


def _summary(sm: StageModules, v: TitanVersion) -> str:
    return (f"autopipe plan for {sm.model or 'the model'}, torchtitan {v.release}: {sm.stages} pipeline ranks"
            + (f" x {sm.virtual_stages} virtual stages" if sm.virtual_stages > 1 else "")
            + f", {sm.microbatches} micro-batches of {sm.microbatch_size}"
            + (f", {sm.dp} data-parallel replicas" if sm.dp > 1 else "")
            + (f", tensor parallel {sm.tp}" + (" (sequence parallel)" if sm.sequence_parallel else "") if sm.tp > 1 else "")
            + (f", expert parallel {sm.ep}" if sm.ep > 1 else "")
            + f"; predicted step {sm.step_time * 1e3:.3f} ms")


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # strings and lists of strings: TOML's basic strings and arrays read the same


def _part_lines(sm: StageModules, parts: TitanParts, indent: str) -> str:
    return "".join(f"{indent}{json.dumps(list(p))},  # part {i}, rank {r}\n"
                   for i, (p, r) in enumerate(zip(parts.parts, sm.chunk_ranks)))  # fmt: skip


def torchtitan_toml(sm: StageModules, parts: TitanParts, v: TitanVersion, job: TitanJob) -> str:
    """torchtitan 0.2's TOML: a whole job file (its defaults fill the rest), or sections to merge."""
    lines = [f"# {_summary(sm, v)}.", "# torchtitan reads it with --job.config_file; merge it into your own config if you have one."]
    head: dict[str, dict[str, object]] = {}
    if job.module:
        head["model"] = {"name": job.module, "flavor": job.flavor}
    if job.module == HF_BACKEND:  # the backend's own settings section, and the model it loads
        head["job"] = {"custom_config_module": f"torchtitan.experiments.{HF_BACKEND}.job_config"}
        head["hf_transformers"] = {"model": job.hf_model or "YOUR/HF-MODEL"}
    for section, values in {**head, **torchtitan_settings(sm, parts, v)}.items():
        lines += ["", f"[{section}]"]
        for key, value in values.items():
            if key == "module_fqns_per_model_part":
                lines.append(f"{key} = [\n{_part_lines(sm, parts, '    ')}]")
            else:
                lines.append(f"{key} = {_value(value)}")
    return "\n".join(lines) + "\n"


def torchtitan_module(sm: StageModules, parts: TitanParts, v: TitanVersion, job: TitanJob) -> str:
    """torchtitan 0.3's config module: ``autopipe_plan()`` returns the model's own config with the plan set."""
    settings = torchtitan_settings(sm, parts, v)
    mode = str(settings.pop("activation_checkpoint")["mode"])
    fn_module, _, fn = job.config_fn.partition(":")
    if job.config_fn:
        base = f"from {fn_module} import {fn} as base_config"
    else:  # a model autopipe cannot name in torchtitan: the user names the function that builds it
        base = "from YOUR_PACKAGE.config_registry import YOUR_CONFIG as base_config  # the config function you train with"
    body = ["    cfg = base_config()"]
    if job.hf_model or job.module == HF_BACKEND:
        body.append(f"    cfg.hf_model = {json.dumps(job.hf_model or 'YOUR/HF-MODEL')}  # the HuggingFace model the backend builds")
    body += [f"    cfg.model_spec.model.{key} = {value!r}  # as the plan's model ({sm.model})" for key, value in job.fields]
    for section, values in settings.items():
        for key, value in values.items():
            if key == "module_fqns_per_model_part":
                body.append(f"    cfg.{section}.{key} = [\n{_part_lines(sm, parts, ' ' * 8)}    ]")
            else:
                body.append(f"    cfg.{section}.{key} = {value!r}")
    imports = {"full": "    from torchtitan.distributed.activation_checkpoint import FullAC\n\n",
               "selective": "    from torchtitan.distributed.activation_checkpoint import SelectiveAC\n\n"}.get(mode, "")
    why = "torchtitan's default is selective" if mode == "none" else "as the plan priced it"
    body.append(f"    cfg.activation_checkpoint = {_AC_03[mode]}  # recompute {mode}: {why}")
    return (f'"""{_summary(sm, v)}.\n\nWritten by `autopipe export --to torchtitan`; torchtitan reads it as '
            f"--module <this file's name> --config {FUNCTION}.\n\"\"\"\n\n{base}\n\n\n"
            f"def {FUNCTION}():\n{imports}" + "\n".join(body) + "\n    return cfg\n")  # fmt: skip


def torchtitan_overrides(sm: StageModules, parts: TitanParts, v: TitanVersion) -> list[str]:
    """The command-line arguments that set the plan on top of the user's own config, in the order the
    release's parser needs: the module lists end at the next flag, 0.3's recompute subcommand comes last."""
    settings = torchtitan_settings(sm, parts, v)
    mode = str(settings.pop("activation_checkpoint")["mode"])
    args: list[str] = []
    for section, values in settings.items():
        for key, value in values.items():
            flag = f"--{section}.{key}"
            if key == "module_fqns_per_model_part":
                args += [flag, *(",".join(p) for p in parts.parts)]
            elif value is True:
                args.append(flag)
            elif value is False:  # tyro's negation of a boolean field
                args.append(f"--{section}.no_{key}")
            else:
                args += [flag, str(value)]
    return args + ([f"--activation_checkpoint.mode", mode] if v.toml else [f"activation-checkpoint:{mode}"])
