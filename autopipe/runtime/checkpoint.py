"""Per-stage checkpoints, written atomically, and export to one safetensors file.

Layout of a checkpoint folder::

    ckpt/step_00000200/            one folder per saved step
        sharded/                   parameters and AdamW state by parameter name, as each rank holds
                                   them (torch.distributed.checkpoint): loads back into any replica
                                   count and any ZeRO stage, each rank reading only its part
        rank00000.pt ...           each rank's step, LR schedule, loss scale, RNG; replica 0's also
                                   its stage's whole parameters (what export reads)
        meta.json                  step, world layout, boundaries, schedule, ZeRO, tied names (written last)

Every rank writes into ``step_N.tmp/``; after a barrier rank 0 writes meta.json and renames the
folder to ``step_N``. A crash at any moment leaves either the complete new folder or a ``.tmp`` one
that ``latest_checkpoint`` ignores; the previous good checkpoint is never touched before that.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import AutopipeError, RecordError

__all__ = ["export", "latest_checkpoint", "load_checkpoint", "read_meta", "save_checkpoint"]

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_checkpoint(trainer: Any, root: str | os.PathLike[str], *, keep: int = 2, data: dict[str, Any] | None = None) -> Path:
    """Save every rank's shard of ``trainer`` under ``root/step_N`` (collective: all ranks call it).

    Keeps the newest ``keep`` checkpoints (0 keeps all). ``data`` (``JobData.state()``) records what
    the run reads; batches are a function of the step, so the step is the data's position and a
    resume continues the data exactly. Returns the folder.
    """
    env = trainer.env
    root = Path(root)
    step = trainer.step_count
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if env.rank == 0:
        if tmp.exists():  # left by a crash while saving this step before
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    env.barrier()
    import torch.distributed.checkpoint as dcp

    # tied copies on several pipeline ranks save under one name with equal values: DCP keeps one
    dcp.save(trainer.tensor_state(), checkpoint_id=tmp / "sharded")
    state = trainer.state_dict()
    part = tmp / f"rank{env.rank:05d}.pt.part"
    with open(part, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, tmp / f"rank{env.rank:05d}.pt")
    env.barrier()
    if env.rank == 0:
        meta = {
            "step": step,
            "world": env.world,
            "dp": env.dp_size,
            "pp": env.pp_size,
            "boundaries": list(trainer.build.layout.boundaries),
            "schedule": trainer.build.layout.schedule,
            "zero": trainer.config.zero,
            "tied": {t.name: list(t.names) for t in trainer.build.tied},
            "config": trainer.config.to_dict(),
            "data": {**(data or {}), "next_step": step},
            "time": time.time(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
        _fsync_dir(tmp)
        if final.exists():  # saving the same step again (after a resume): replace it whole
            old = root / f"step_{step:08d}.old"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        _fsync_dir(root)
        if keep > 0:
            for stale in _step_dirs(root)[:-keep]:
                shutil.rmtree(stale, ignore_errors=True)
    env.barrier()
    return final


def _step_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint folder under ``root`` (None if there is none)."""
    dirs = _step_dirs(Path(root))
    return dirs[-1] if dirs else None


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path) / "meta.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise RecordError(f"{p} is missing or unreadable ({e}); the checkpoint is incomplete.") from e


def load_checkpoint(trainer: Any, path: str | os.PathLike[str]) -> int:
    """Load checkpoint folder ``path`` into ``trainer`` (collective); returns the step.

    The pipeline must be the one it was saved with; the replica count and the ZeRO stage may
    differ: torch.distributed.checkpoint reshards parameters and AdamW state to what this rank
    holds now, and replicas of one stage share the rest (step, schedule, RNG), so replica d reads
    the file of saved replica d mod R.
    """
    import torch.distributed.checkpoint as dcp

    env = trainer.env
    path = Path(path)
    meta = read_meta(path)
    if meta["pp"] != env.pp_size:
        raise AutopipeError(
            f"checkpoint {path} was saved by {meta['pp']} pipeline ranks but this run has {env.pp_size}; "
            f"resume with {meta['pp']} stages (any --dp), or export it and start a new run from the exported weights (--weights)."
        )
    if not (path / "sharded").is_dir():
        raise AutopipeError(f"checkpoint {path} has no sharded/ state (made by an older autopipe); export it and start from --weights.")
    source = env.global_rank(env.dp_rank % int(meta["dp"]), env.pp_rank)
    state = torch.load(path / f"rank{source:05d}.pt", map_location=env.device, weights_only=False)
    trainer.load_state_dict(state)
    dcp.load(trainer.tensor_state(), checkpoint_id=path / "sharded")  # in place, into this rank's shards
    trainer.build.sync_alias_params_()
    return int(meta["step"])


def export(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    model_fn: Callable[[], nn.Module] | None = None,
) -> Path:
    """Join a checkpoint's stage shards into ``out_dir/model.safetensors``.

    Tied tensors are written under every name the model has for them, so any loader finds the key
    it expects. With ``model_fn`` building a HuggingFace model, its config.json is written too and
    ``AutoModel...from_pretrained(out_dir)`` loads the result. Reads replica 0's shards only.
    """
    from safetensors.torch import save_file

    meta = read_meta(path)
    tensors: dict[str, torch.Tensor] = {}
    for pp_rank in range(meta["pp"]):
        state = torch.load(Path(path) / f"rank{pp_rank:05d}.pt", map_location="cpu", weights_only=False)
        for name, value in state["params"].items():
            tensors.setdefault(name, value.contiguous())
    for canonical, names in meta.get("tied", {}).items():
        if canonical in tensors:
            for alias in names:
                if alias not in tensors:
                    tensors[alias] = tensors[canonical].clone()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / "model.safetensors"
    part = out / "model.safetensors.part"
    save_file(tensors, str(part), metadata={"format": "pt", "step": str(meta["step"])})
    os.replace(part, target)
    if model_fn is not None:
        with torch.device("meta"):
            model = model_fn()
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(out)
    return target
