"""A trained model as one safetensors file: from a checkpoint, or straight from a run's last step.

- ``export(ckpt, out_dir)`` joins a checkpoint folder's weights into ``out_dir/model.safetensors``:
  from its ``sharded/`` state (torch.distributed.checkpoint, read here in one process, each tensor
  whole whatever replica count and ZeRO stage saved it), or from rank files that hold a stage's
  whole parameters (``params``: DeepSpeed's final weights, checkpoints of autopipe before 0.2).
- ``export_final(trainer, out_dir)`` (collective) writes the weights the run holds now, without a
  checkpoint: a run need not save gigabytes of optimizer state to hand over its model.
  Replica 0 of each stage writes its stage's whole parameters into a folder under ``out_dir``,
  rank 0 joins them and removes the folder.
- ``checkpoint_params(ckpt)``: a checkpoint's parameters by name, each tensor once.

Tied tensors are written under every name the model has for them, so any loader finds the key it
expects; with ``model_fn`` building a HuggingFace model its config.json is written too, and
``AutoModel...from_pretrained(out_dir)`` loads the folder.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...choices import world_rank
from .folders import read_meta

__all__ = ["checkpoint_params", "export", "export_final", "write_stage_weights"]

_PARAM = "param/"  # tensor_state's prefix for parameters (``optim/`` for optimizer state)


def checkpoint_params(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every parameter a checkpoint holds, by name, whole and in host memory (no process group needed).

    A tensor tied across stages is saved once (under its first name); ``export`` adds its other names.
    """
    path = Path(path)
    meta = read_meta(path)
    if (path / "sharded").is_dir():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        reader = dcp.FileSystemReader(str(path / "sharded"))
        saved = reader.read_metadata().state_dict_metadata
        state = {key: torch.empty(tuple(m.size), dtype=m.properties.dtype)
                 for key, m in saved.items() if key.startswith(_PARAM) and isinstance(m, TensorStorageMetadata)}
        dcp.load(state, storage_reader=reader, no_dist=True)
        return {key[len(_PARAM):]: value for key, value in state.items()}
    tensors: dict[str, torch.Tensor] = {}
    for pp_rank in range(int(meta["pp"])):
        first = world_rank(0, pp_rank, dp=int(meta.get("dp", 1)), pp=int(meta["pp"]),
                           placement=meta.get("placement", "pipeline-inner"), tp=int(meta.get("tp", 1)))  # replica 0's file
        state = torch.load(path / f"rank{first:05d}.pt", map_location="cpu", weights_only=False)
        for name, value in state["params"].items():
            tensors.setdefault(name, value.contiguous())
    return tensors


def export(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_fn: Callable[[], nn.Module] | None = None,
) -> Path:
    """Join a checkpoint's weights into ``out_dir/model.safetensors`` (see the module docstring)."""
    from safetensors.torch import save_file

    meta = read_meta(path)
    tensors = checkpoint_params(path)
    for canonical, names in meta.get("tied", {}).items():
        if canonical in tensors:
            for alias in names:
                if alias not in tensors:
                    tensors[alias] = tensors[canonical].clone()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    part = out / "model.safetensors.part"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(part),
              metadata={"format": "pt", "step": str(meta["step"])})
    os.replace(part, target)
    if model_fn is not None:
        with torch.device("meta"):
            model = model_fn()
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(out)
    return target


def export_final(trainer: Any, out_dir: str | os.PathLike[str], *,
                 model_fn: Callable[[], nn.Module] | None = None) -> Path:
    """The weights ``trainer`` holds now as ``out_dir/model.safetensors`` (collective: every rank
    calls it). Written through a folder of stage files under ``out_dir`` that rank 0 joins and
    removes, so ``out_dir`` must be a folder every rank sees (as a checkpoint folder must)."""
    env = trainer.env
    out = Path(out_dir)
    parts = out / f".autopipe-weights-step{trainer.step_count}"
    if env.rank == 0:
        shutil.rmtree(parts, ignore_errors=True)  # left by a run that stopped while exporting
        parts.mkdir(parents=True)
    env.barrier()
    trainer.save_final(parts)  # collective: sharded parameters are gathered over the replicas
    target = out / "model.safetensors"
    if env.rank == 0:
        try:
            export(parts, out, model_fn=model_fn)
        finally:
            shutil.rmtree(parts, ignore_errors=True)
    env.barrier()
    return target


def write_stage_weights(folder: Path, stage: int, params: dict[str, torch.Tensor],
                        meta: dict[str, Any] | None = None) -> None:
    """One stage's whole parameters as ``folder/rank{stage}.pt`` (+ ``meta.json`` when given): the
    folder layout ``export`` reads from rank files."""
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"rank{stage:05d}.pt.part"
    torch.save({"params": params}, part)
    os.replace(part, folder / f"rank{stage:05d}.pt")
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta, indent=2))
