"""Per-stage checkpoints, written atomically; each weight stored once.

Layout of a checkpoint folder::

    ckpt/step_00000200/            one folder per saved step
        sharded/                   parameters and optimizer state by parameter name, as each rank
                                   holds them (torch.distributed.checkpoint): loads back into any
                                   replica count and any ZeRO stage, each rank reading only its part;
                                   a tensor tied across stages is stored once
        rank00000.pt ...           each rank's step, LR schedule, loss scale, RNG: a few kilobytes
        meta.json                  step, world layout, boundaries, schedule, ZeRO, tied names (written last)

So a checkpoint is the weights plus the optimizer state (GPT-2 124M with AdamW: 1.5 GB), once.
``autopipe.runtime.checkpoints.exports`` joins the weights into one safetensors file.

Every rank writes into ``step_N.tmp/``; after a barrier rank 0 writes meta.json and renames the
folder to ``step_N``. A crash at any moment leaves either the complete new folder or a ``.tmp`` one
that ``latest_checkpoint`` ignores; the previous good checkpoint is never touched before that.

One folder holds one run. A run that saves into a folder holding another run's checkpoints is
refused in one line (``check_ckpt_dir``, at the start of train.py; ``save_checkpoint`` checks again
before its first save), unless it resumed from them: so ``--ckpt-keep`` rotates only this run's
checkpoints, never the one just written, and the newest checkpoint in the folder, which
``--resume`` takes, is always this run's.

The checkpoint folder must be one folder for every rank: on several nodes, a filesystem they all
mount. A folder of each node's own cannot hold a checkpoint at all: rank 0 alone completes it (the
other nodes' parts would stay in ``step_N.tmp``), torch.distributed.checkpoint writes its index
from rank 0 only and keeps one copy of a replicated tensor, on one rank's node. The first save (and
``--resume``) checks that every rank sees what rank 0 writes there, and says so in one line if not.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from ...choices import world_rank
from ...errors import AutopipeError
from .folders import check_ckpt_dir, checkpoint_dirs, read_meta

__all__ = ["check_shared_folder", "load_checkpoint", "materialize_state_", "save_checkpoint"]

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

    Keeps the newest ``keep`` checkpoints (0 keeps all); a folder holding another run's checkpoints
    is refused before anything is written (``check_ckpt_dir``). ``data`` (``JobData.state()``) records what
    the run reads; batches are a function of the step, so the step is the data's position and a
    resume continues the data exactly. Returns the folder.
    """
    env = trainer.env
    root = Path(root)
    check_shared_folder(env, root)
    check_ckpt_dir(root)
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
            "tp": getattr(env, "tp_size", 1),  # DCP keeps each tp shard once, by its global offsets
            "ep": getattr(env, "ep_size", 1),  # each expert slice too (a resume may take another ep)
            "placement": env.placement,
            "boundaries": list(trainer.build.plan.boundaries),
            "schedule": trainer.build.plan.schedule,
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
        if keep > 0:  # this run's older checkpoints (the folder holds no other run's); never the new one
            for stale in checkpoint_dirs(root)[:-keep]:
                if stale != final:
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
    saved_dp, saved_tp = int(meta["dp"]), int(meta.get("tp", 1))
    # a rank file (step, schedule, RNG) is the same on every tp rank of a stage: tp degrees may differ too,
    # torch.distributed.checkpoint reshards the DTensors to this run's tp shards
    source = world_rank(env.dp_rank % saved_dp, env.pp_rank, dp=saved_dp, pp=env.pp_size,
                        placement=meta.get("placement", "pipeline-inner"), tp=saved_tp,
                        tp_rank=getattr(env, "tp_rank", 0) % saved_tp)
    # into host memory, mapped rather than read: the RNG states must be host tensors, and replica 0's
    # whole weights (for export) are not wanted here: the trained ones come from sharded/ below
    state = torch.load(path / f"rank{source:05d}.pt", map_location="cpu", mmap=True, weights_only=False)
    state.pop("params", None)  # checkpoints before autopipe 0.2 repeated replica 0's weights here
    saved_optimizer = meta.get("config", {}).get("optimizer", "adamw")
    if saved_optimizer != trainer.config.optimizer:
        raise AutopipeError(f"checkpoint {path} was trained with --optimizer {saved_optimizer} but this run uses "
                            f"{trainer.config.optimizer}; resume with --optimizer {saved_optimizer}, or export it and "
                            "start a new run from the exported weights (--weights).")
    trainer.load_state_dict(state)

    materialize_state_(trainer.optimizer)  # SGD's and Adafactor's state exists from their first step on
    dcp.load(trainer.tensor_state(), checkpoint_id=path / "sharded")  # in place, into this rank's shards
    trainer.build.sync_alias_params_()
    return int(meta["step"])


@torch.no_grad()
def materialize_state_(optimizer: torch.optim.Optimizer) -> None:
    """Create every parameter's optimizer state, so that a checkpoint can be loaded into it in place.

    SGD and Adafactor make their state at their first step, and a checkpoint's state is loaded
    into tensors that exist (torch.distributed.checkpoint loads in place). One step at learning
    rate 0 on zero gradients makes it: no parameter moves, and the state it writes (zeros, a step
    count) is overwritten by the load. Adam(W)'s is made by ``preallocate_`` already. Collective
    under ZeRO 1 (the step broadcasts each replica's parameters).
    """
    # ZeroRedundancyOptimizer's local optimizer, and under ep ZeRO 1's expert optimizer beside it
    inners = [getattr(optimizer, "optim", optimizer)]
    experts = getattr(optimizer, "experts", None)
    if experts is not None:
        inners.append(getattr(experts, "optim", experts))
    if all(inner.state.get(p) for inner in inners for g in inner.param_groups for p in g["params"] if p.requires_grad):
        return
    groups = [*optimizer.param_groups, *(getattr(optimizer, "expert_param_groups", list)())]
    saved = [(g, g["lr"]) for g in groups]
    grads = {id(p): p.grad for g in groups for p in g["params"]}
    for g in groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
            elif p.grad is not None:
                p.grad.zero_()
    optimizer.step()
    for g, lr in saved:
        g["lr"] = lr
        for p in g["params"]:
            if grads[id(p)] is None:
                p.grad = None
