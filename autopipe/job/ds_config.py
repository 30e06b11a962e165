"""A DeepSpeed user's own ds_config, merged with the plan: ``convert --engine deepspeed --ds-config my.json``.

A DeepSpeed user keeps the settings they tuned in their config: the ZeRO stage, bf16, gradient
clipping, the communication and logging keys. The plan owns the pipeline's: the micro-batch size
(``train_micro_batch_size_per_gpu``), the micro-batches per step (``gradient_accumulation_steps``)
and so ``train_batch_size``. So:

- what the file says of the ZeRO stage, bf16, the clip, the micro-batch size and count becomes
  what convert plans with, unless convert was given another value (then one line names both);
- the job's ds_config.json is the user's file with the plan's pipeline keys and autopipe's own
  (its optimizer section and clip, see ``autopipe.runtime.deepspeed_engine.settings``) written
  over it; every other key is kept as the user wrote it.

fp16 is refused in one line: DeepSpeed's fp16 mode (and its loss scaling) casts the weights, which
the traced layers do not survive; bf16 trains as autocast over fp32 weights on both engines, and
fp16 with dynamic loss scaling runs on ``--engine torch``.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..errors import AutopipeError
from .settings import ConvertSettings

__all__ = ["PIPELINE_KEYS", "apply_ds_config", "merge_ds_config", "read_ds_config"]

# what the plan decides, whatever the file said (the file's values must agree with it)
PIPELINE_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
# and what autopipe owns besides: the stage it planned, its clip and optimizer (built by autopipe itself)
_OWNED = {*PIPELINE_KEYS, "zero_optimization", "gradient_clipping", "optimizer", "bf16", "autopipe"}


def read_ds_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The user's ds_config as a dict, or one line saying why it cannot be read."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AutopipeError(f"--ds-config {path} does not exist.") from None
    except (OSError, ValueError) as e:
        raise AutopipeError(f"--ds-config {path} is not a readable JSON file ({e}).") from None
    if not isinstance(data, dict):
        raise AutopipeError(f"--ds-config {path} holds a {type(data).__name__}, not a DeepSpeed config object.")
    return data


def apply_ds_config(settings: ConvertSettings, user: dict[str, Any], path: str) -> ConvertSettings:
    """``settings`` with what ``user`` (the file at ``path``) says of the ZeRO stage, precision, clip,
    micro-batch size and count; a convert option given another value than the file's is one line."""
    if settings.engine != "deepspeed":
        raise AutopipeError(f"--ds-config is DeepSpeed's config: use it with --engine deepspeed (got --engine "
                            f"{settings.engine}).")
    if (user.get("fp16") or {}).get("enabled"):
        raise AutopipeError(f"{path} enables fp16: DeepSpeed's fp16 (and its loss scaling) casts the weights, which "
                            "the traced layers do not survive; use bf16 there (autocast over fp32 weights), or "
                            "--engine torch --dtype fp16 (dynamic loss scaling).")
    if user.get("wall_clock_breakdown"):
        raise AutopipeError(f"{path} sets wall_clock_breakdown: DeepSpeed's pipeline engine then fails on its own timers "
                            "('bwd_microstep timer has already been started', deepspeedai/DeepSpeed#745); set it false "
                            "(the job's step line gives each stage's time).")
    if user.get("scheduler"):
        raise AutopipeError(f"{path} has a scheduler section: autopipe builds the LR schedule itself, the same on both "
                            "engines (--warmup, --lr-schedule); drop the section and give those instead.")
    bf16 = (user.get("bf16") or {}).get("enabled")
    optimizer = user.get("optimizer") or {}
    params = optimizer.get("params") or {}
    kind = str(optimizer.get("type", "")).lower()
    if kind and kind not in _OPTIMIZERS:
        raise AutopipeError(f"{path} asks for DeepSpeed's {optimizer['type']} optimizer; autopipe builds AdamW, SGD or "
                            "Adafactor itself (the same on both engines): use one of those.")
    said = {
        "optimizer": _OPTIMIZERS.get(kind),
        "lr": params.get("lr"),
        "weight_decay": params.get("weight_decay"),
        "betas": tuple(params["betas"]) if "betas" in params else None,
        "momentum": params.get("momentum"),
        "zero": (user.get("zero_optimization") or {}).get("stage"),
        "dtype": "bf16" if bf16 else None,
        "grad_clip": user.get("gradient_clipping"),
        "batch_size": user.get("train_micro_batch_size_per_gpu"),
        "microbatches": user.get("gradient_accumulation_steps"),
    }
    defaults = {f.name: f.default for f in fields(ConvertSettings)}
    flags = {"zero": "--zero", "dtype": "--dtype", "grad_clip": "--grad-clip", "batch_size": "--batch-size",
             "microbatches": "--microbatches", "optimizer": "--optimizer", "lr": "--lr", "weight_decay": "--weight-decay",
             "betas": "--betas", "momentum": "--momentum"}
    taken: dict[str, Any] = {}
    for name, value in said.items():
        if value is None:
            continue
        given = getattr(settings, name)
        if given != defaults[name] and _value(given) != _value(value):
            shown = json.dumps(bf16) if name == "dtype" else value
            raise AutopipeError(f"{path} says {_key(name)} {shown} but {flags[name]} {given} was given; drop one, or "
                                "make them agree.")
        taken[name] = int(value) if name in ("zero", "batch_size", "microbatches") else value
    total = user.get("train_batch_size")
    if total is not None and said["batch_size"] and said["microbatches"]:
        each = int(said["batch_size"]) * int(said["microbatches"]) * settings.dp
        if int(total) != each:
            raise AutopipeError(f"{path}: train_batch_size {total} is not train_micro_batch_size_per_gpu x "
                                f"gradient_accumulation_steps x replicas = {each}; fix one of them.")
    return replace(settings, **taken) if taken else settings


def merge_ds_config(user: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """The job's ds_config.json: the user's keys, with the plan's pipeline keys and what autopipe
    owns (``job``: what ``ds_config`` made for the plan: the ZeRO stage, the clip, the optimizer)
    written over them, nested sections merged; autopipe's other defaults (logging) only where the
    user set nothing."""
    out = dict(user)
    for key, value in job.items():
        if key not in _OWNED and key in user:
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def _value(v: Any) -> Any:
    """A setting's value as the file and convert's options compare it (the precision's spelling)."""
    return {"bfloat16": "bf16", "float32": "fp32"}.get(v, v) if isinstance(v, str) else v


def _key(name: str) -> str:
    return {"zero": "zero_optimization.stage", "dtype": "bf16.enabled", "grad_clip": "gradient_clipping",
            "batch_size": "train_micro_batch_size_per_gpu", "microbatches": "gradient_accumulation_steps",
            "optimizer": "optimizer.type", "lr": "optimizer.params.lr", "weight_decay": "optimizer.params.weight_decay",
            "betas": "optimizer.params.betas", "momentum": "optimizer.params.momentum"}[name]


# DeepSpeed's optimizer names autopipe builds (its own, so both engines train the same numbers)
_OPTIMIZERS = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd", "adafactor": "adafactor"}
