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

So the checkpoint folder must be one folder for every rank: on several nodes, a filesystem they all
mount. A folder of each node's own cannot hold a checkpoint at all: rank 0 alone completes it (the
other nodes' parts would stay in ``step_N.tmp``), torch.distributed.checkpoint writes its index
from rank 0 only and keeps one copy of a replicated tensor, on one rank's node. The first save (and
``--resume``) checks that every rank sees what rank 0 writes there, and says so in one line if not.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..choices import world_rank
from ..errors import AutopipeError, RecordError

__all__ = ["check_shared_folder", "export", "latest_checkpoint", "load_checkpoint", "read_meta", "save_checkpoint"]

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
    check_shared_folder(env, root)
    step = trainer.step_count
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    if env.rank == 0:
        if tmp.exists():  # left by a crash while saving this step before
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    env.barrier()
    tmp.mkdir(parents=True, exist_ok=True)  # rank 0 made it; a network filesystem may not show it yet
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
            "placement": env.placement,
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


_SHARED: set[str] = set()  # folders this process has found every rank to see


def check_shared_folder(env: Any, root: str | os.PathLike[str]) -> None:
    """Refuse, in one line, a checkpoint folder some ranks do not share (collective: all ranks call it).

    Rank 0 writes a probe file with a fresh name under ``root``; every rank looks for it and says
    whether it saw it. Done once per folder and process, so only the first save pays for it.
    """
    root = Path(root)
    key = os.path.abspath(root)
    if env.world == 1 or key in _SHARED:
        return
    comm = env.comm
    token = torch.zeros(1, dtype=torch.int64, device=env.device)
    if env.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        token.fill_(secrets.randbits(62) + 1)
    comm.all_reduce(token, op="max", where="checkpoint folder check")  # rank 0's name, everywhere
    probe = root / f".autopipe-probe-{int(token.item()):x}"
    if env.rank == 0:
        probe.write_text("written by rank 0 to check that every rank sees this folder\n")
    env.barrier()
    seen = torch.tensor([1 if _sees(probe) else 0], dtype=torch.int64, device=env.device)
    flags = comm.all_gather(seen, where="checkpoint folder check").view(-1).tolist()
    if env.rank == 0:
        probe.unlink(missing_ok=True)
    blind = [r for r, f in enumerate(flags) if not f]
    if blind:
        raise AutopipeError(
            f"checkpoint folder {root} is not one folder for every rank: rank(s) {_ranges(blind)} do not see the files "
            "rank 0 writes there (each node has a folder of its own); put --ckpt-dir on a filesystem every node "
            "mounts (NFS, Lustre, ...): every rank writes its part of each checkpoint into one folder."
        )
    _SHARED.add(key)


def _sees(path: Path, tries: int = 5) -> bool:
    """Whether ``path`` exists, asked again a few times: a network filesystem may show another
    node's new file a moment late (listing the folder makes NFS look again)."""
    for i in range(tries):
        try:
            if path.name in os.listdir(path.parent):
                return True
        except OSError:
            pass
        if i + 1 < tries:
            time.sleep(0.2 * (i + 1))
    return False


def _ranges(ranks: list[int]) -> str:
    """'1, 4-7' for [1, 4, 5, 6, 7].

    >>> _ranges([1, 4, 5, 6, 7])
    '1, 4-7'
    """
    parts: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(parts)


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
    saved_dp = int(meta["dp"])
    source = world_rank(env.dp_rank % saved_dp, env.pp_rank, dp=saved_dp, pp=env.pp_size,
                        placement=meta.get("placement", "pipeline-inner"))
    # into host memory, mapped rather than read: the RNG states must be host tensors, and replica 0's
    # whole weights (for export) are not wanted here: the trained ones come from sharded/ below
    state = torch.load(path / f"rank{source:05d}.pt", map_location="cpu", mmap=True, weights_only=False)
    state.pop("params", None)
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
        first = world_rank(0, pp_rank, dp=int(meta.get("dp", 1)), pp=int(meta["pp"]),
                           placement=meta.get("placement", "pipeline-inner"))  # replica 0's file
        state = torch.load(Path(path) / f"rank{first:05d}.pt", map_location="cpu", weights_only=False)
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
