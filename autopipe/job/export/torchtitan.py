"""torchtitan (and NeMo Automodel): the ``[parallelism]`` section as TOML, and the command-line overrides.

torchtitan builds each model part by deep-copying the model and keeping the modules listed for it in
``module_fqns_per_model_part`` (one list per virtual stage, in model order; the schedule's style puts
part i on rank ``i % pp`` or, for ZBVZeroBubble, in a V). The micro-batch count is
``training.local_batch_size / pipeline_parallel_microbatch_size``. Data parallelism maps to
``data_parallel_replicate_degree`` (ZeRO 0) or ``data_parallel_shard_degree`` (FSDP2: ZeRO 3, or 2 with
``fsdp_reshard_after_forward = "never"``); recompute to ``[activation_checkpoint] mode``.

Example:
    >>> from autopipe.job.export.modules import StageModules
    >>> sm = StageModules("torchtitan", "llama", 2, 1, "1f1b", 4, 1, 1, 0, "none", (0, 1), ((0, 2), (2, 4)),
    ...                   (("tok_embeddings", "layers.0"), ("layers.1", "norm", "output")))
    >>> print(torchtitan_toml(sm).split("[parallelism]")[1].splitlines()[1:4])
    ['pipeline_parallel_degree = 2', 'pipeline_parallel_schedule = "1F1B"', 'pipeline_parallel_microbatch_size = 1']
"""

from __future__ import annotations

import json

from ...planner.targets import TARGETS
from .modules import StageModules

__all__ = ["torchtitan_toml", "torchtitan_overrides", "torchtitan_settings"]


def torchtitan_settings(sm: StageModules) -> dict[str, dict[str, object]]:
    """Section -> field -> value, in torchtitan's names (module_fqns_per_model_part a list of lists)."""
    parallelism: dict[str, object] = {
        "pipeline_parallel_degree": sm.stages,
        "pipeline_parallel_schedule": TARGETS["torchtitan"].schedule_name(sm.schedule),
        "pipeline_parallel_microbatch_size": sm.microbatch_size,
        "data_parallel_replicate_degree": sm.dp if sm.zero == 0 else 1,
        "data_parallel_shard_degree": sm.dp if sm.zero in (2, 3) else 1,
    }
    if sm.dp > 1 and sm.zero == 2:  # FSDP2 keeping the parameters gathered between forward and backward
        parallelism["fsdp_reshard_after_forward"] = "never"
    parallelism["module_fqns_per_model_part"] = [list(m) for m in sm.modules]
    out: dict[str, dict[str, object]] = {
        "parallelism": parallelism,
        "training": {"local_batch_size": sm.microbatch_size * sm.microbatches},
    }
    if sm.recompute != "none":
        out["activation_checkpoint"] = {"mode": sm.recompute}
    return out


def _value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(v)  # strings and lists of strings: TOML's basic strings and arrays read the same


def torchtitan_toml(sm: StageModules) -> str:
    """The sections as TOML, to merge into the job's config file."""
    lines = [
        f"# autopipe plan for {sm.model or 'the model'}: {sm.stages} pipeline ranks"
        + (f" x {sm.virtual_stages} virtual stages" if sm.virtual_stages > 1 else "")
        + f", {sm.microbatches} micro-batches of {sm.microbatch_size}"
        + (f", {sm.dp} data-parallel replicas" if sm.dp > 1 else ""),
        f"# predicted step {sm.step_time * 1e3:.3f} ms; merge these keys into your torchtitan config.",
    ]
    for section, fields in torchtitan_settings(sm).items():
        lines.append("")
        lines.append(f"[{section}]")
        for key, value in fields.items():
            if key == "module_fqns_per_model_part":
                parts = "".join(f"    {json.dumps(list(m))},  # part {i}, rank {r}\n"
                                for i, (m, r) in enumerate(zip(sm.modules, sm.chunk_ranks)))  # fmt: skip
                lines.append(f"{key} = [\n{parts}]")
            else:
                lines.append(f"{key} = {_value(value)}")
    return "\n".join(lines) + "\n"


def torchtitan_overrides(sm: StageModules) -> str:
    """The same as command-line overrides (``--section.field value``), but for the module lists, which
    stay in the TOML's ``[parallelism]`` section (a list of lists has no flag form torchtitan reads)."""
    flags = []
    for section, fields in torchtitan_settings(sm).items():
        for key, value in fields.items():
            if key != "module_fqns_per_model_part":
                flags.append(f"--{section}.{key} {value}")
    return " \\\n  ".join(flags) + "\n"
