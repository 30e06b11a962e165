"""DeepSpeed's settings for a job: its ds_config.json, and the flags and plans its engine cannot run.

autopipe builds the optimizer and the LR schedule itself (the torch engine's: AdamW, SGD or
Adafactor, warmup then cosine, linear or constant), so both engines train the same numbers; the ds_config keeps what DeepSpeed owns (batch
sizes, ZeRO stage, clipping under ZeRO 1). Precision is autocast over fp32 weights on both engines.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import AutopipeError
from ...planner.stage_plan import StagePlan
from ..training.optim import TrainConfig

__all__ = ["CLIP_NOTE", "ds_config", "load_ds_config", "refuse_flags", "refuse_plan"]


# what the job's ds_config.json says of its clip (ZeRO 0), beside DeepSpeed's own gradient_clipping of 0
CLIP_NOTE = ("autopipe clips by the whole model's gradient norm (every stage, each tied tensor once, as the "
             "unpipelined model); DeepSpeed's gradient_clipping would take stage 0's norm only, so it is 0")


def ds_config(config: TrainConfig, *, rows: int, dp: int) -> dict[str, Any]:
    """The job's ds_config.json: batch sizes, precision, clipping, the optimizer, ZeRO.

    autopipe builds the optimizer and the LR schedule itself from the ``optimizer`` section (the
    job's optimizer, decay on matrices only, its LR schedule: the torch engine's, so both engines
    train the same numbers). Under ZeRO stage 0 autopipe clips by the whole model's gradient norm
    (every stage's gradients, each tied tensor once, as the unpipelined model's ``clip_grad_norm_``):
    DeepSpeed's own ``gradient_clipping`` on a pipeline takes stage 0's norm (8.56 where the whole
    model's was 10.11 on a 2-stage GPT-2), so the file sets it to 0 and says so under ``"autopipe"``,
    with the clip autopipe applies. Stage 1 (what DeepSpeed allows with pipelines) shards the
    optimizer state over replicas, and then DeepSpeed clips and reports the norm itself.

    Example:
        >>> from autopipe.runtime.training.optim import TrainConfig
        >>> cfg = ds_config(TrainConfig(microbatches=8, grad_clip=1.0), rows=4, dp=1)
        >>> cfg["gradient_clipping"], cfg["autopipe"]["gradient_clipping"]
        (0.0, 1.0)
    """
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": config.microbatches,
        "train_batch_size": rows * config.microbatches * dp,
        "gradient_clipping": config.grad_clip if config.zero >= 1 else 0.0,
        "optimizer": {"type": _DS_NAMES[config.optimizer], "params": _optimizer_params(config)},
        "zero_optimization": {"stage": config.zero},  # the plan's (convert refuses 2/3 for DeepSpeed)
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.zero == 0:
        cfg["autopipe"] = {"gradient_clipping": config.grad_clip, "clip_norm": CLIP_NOTE}
    if config.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif config.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return cfg


_DS_NAMES = {"adamw": "AdamW", "sgd": "SGD", "adafactor": "Adafactor"}


def _optimizer_params(config: TrainConfig) -> dict[str, Any]:
    """The ds_config's optimizer section: the settings of ``config.optimizer`` a person may edit."""
    out: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.optimizer == "adamw":
        out.update(betas=list(config.betas), eps=config.eps)
    elif config.optimizer == "sgd":
        out["momentum"] = config.momentum
    return out


def load_ds_config(path: str | None, config: TrainConfig, args: Any, dp: int) -> tuple[dict[str, Any], TrainConfig]:
    """The ds_config to run with: ``--deepspeed_config``, else the job's ds_config.json, else made
    from the flags. The flags (batch size, micro-batches, lr, clip) override what the file says, as
    they do for the torch engine; the file's optimizer settings are kept; its precision and ZeRO
    stage must agree with train.py's (one line when they do not)."""
    from dataclasses import replace

    cfg = ds_config(config, rows=args.batch_size, dp=dp)
    user: dict[str, Any] = {}
    if path is not None:
        try:
            user = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise AutopipeError(f"{path} is not a readable ds_config.json ({e}).") from None
        cfg.update({k: v for k, v in user.items() if k not in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")})
        params = (user.get("optimizer") or {}).get("params", {})
        kind = str((user.get("optimizer") or {}).get("type", _DS_NAMES[config.optimizer])).lower()
        if kind not in (config.optimizer, "adam" if config.optimizer == "adamw" else config.optimizer):
            raise AutopipeError(f"{path}: optimizer {user['optimizer'].get('type')!r} but --optimizer is "
                                f"{config.optimizer}; make them agree (autopipe builds {', '.join(_DS_NAMES.values())}).")
        config = replace(config, betas=tuple(params.get("betas", config.betas)), eps=float(params.get("eps", config.eps)),
                         weight_decay=float(params.get("weight_decay", config.weight_decay)),
                         momentum=float(params.get("momentum", config.momentum)))
    # precision is autocast over fp32 weights, as on the torch engine: the traced layers carry the
    # dtypes of the trace (a norm's upcast and cast back), which DeepSpeed's own bf16/fp16 modes, casting
    # the weights, break ("expected m1 and m2 to have the same dtype")
    wanted = "bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp16" if (cfg.get("fp16") or {}).get("enabled") else "fp32"
    if path is not None and wanted != config.dtype:
        raise AutopipeError(f"{path} trains in {wanted} but --dtype is {config.dtype}; make them agree.")
    if config.dtype == "fp16":
        raise AutopipeError("--dtype fp16 on --engine deepspeed: use bf16 (autocast, fp32 weights), or fp16 on --engine torch.")
    cfg.pop("bf16", None)
    cfg.pop("fp16", None)
    if getattr(args, "zero", None) is not None:  # train.py's zero (the plan's, or --zero): the file must agree
        from ..training.optim import check_zero

        zero = check_zero(args.zero)
        given = (user.get("zero_optimization") or {}).get("stage") if path is not None else None
        if given is not None and int(given) != zero:
            raise AutopipeError(f"{path} runs ZeRO stage {given} but train.py's zero is {zero}; make them agree "
                                f"(--zero {given}, or the file's zero_optimization.stage).")
        cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": zero}
    stage = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    if stage >= 1:
        cfg["zero_allow_untested_optimizer"] = True  # autopipe's AdamW (autopipe.runtime.deepspeed_engine.trainer clips in it) is a client optimizer
    if stage > 1:
        raise AutopipeError(f"ZeRO stage {stage} in the ds_config: DeepSpeed's pipeline engine allows stage 0 or 1.")
    cfg["gradient_clipping"] = config.grad_clip if stage >= 1 else 0.0  # stage 0: autopipe.runtime.deepspeed_engine.trainer clips (each tied tensor once)
    cfg.pop("autopipe", None)  # what autopipe.runtime.deepspeed_engine.trainer does, not DeepSpeed: the --grad-clip flag sets the clip
    cfg.pop("optimizer", None)  # built here (see ds_config)
    cfg.pop("scheduler", None)
    return cfg, config


def refuse_flags(args: Any) -> None:
    """Flags the DeepSpeed engine does not run: one line each, before anything starts."""
    from ...planner.stage_plan import schedule_name

    if getattr(args, "verify", False):
        raise AutopipeError("--verify runs on the torch engine (--engine torch); DeepSpeed's engine has no unpipelined twin to compare with.")
    if getattr(args, "recompute", "plan") not in ("plan", "none"):
        raise AutopipeError("--recompute selective|full runs on the torch engine; with DeepSpeed set activation checkpointing in ds_config.json.")
    zero = getattr(args, "zero", None)
    if zero is not None and str(zero).strip() in ("2", "3"):
        raise AutopipeError(f"--zero {zero} on --engine deepspeed: DeepSpeed's pipeline engine runs ZeRO 0 or 1 only; "
                            "use --engine torch (FSDP2) for ZeRO 2 or 3.")
    if schedule_name(getattr(args, "schedule", "1f1b")) not in ("1F1B", "GPipe"):
        raise AutopipeError(f"--schedule {args.schedule}: DeepSpeed runs its own 1F1B schedule; use --engine torch for {args.schedule}.")


def refuse_plan(plan: StagePlan | None, plan_path: str, args: Any) -> None:
    """A plan whose chunks recompute (its memory counted on it) does not run as planned on DeepSpeed."""
    modes = plan.recompute if plan is not None else ()
    if getattr(args, "recompute", "plan") == "plan" and any(m != "none" for m in modes):
        raise AutopipeError(
            f"{plan_path} recomputes activations ({' '.join(modes)}), which --engine deepspeed does not do: "
            "re-plan with --recompute none, pass --recompute none to run it without, or use --engine torch."
        )
