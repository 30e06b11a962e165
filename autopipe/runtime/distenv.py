"""Where each rank runs: its device, a (dp, pp) DeviceMesh over the world, one group per tied tensor.

The device is decided here and nowhere else (``rank_device``): ``LOCAL_RANK`` -> ``cuda:LOCAL_RANK``
when GPUs are visible (made current before the process group exists, and given to it as
``device_id`` so NCCL binds its communicator to that GPU at once), else the CPU with gloo. Every
other module takes ``DistEnv.device``; batches reach it through ``to_device`` (pinned, non-blocking
copies on a GPU); collectives go through ``DistEnv.comm`` (:mod:`autopipe.runtime.comm`).

Global rank = dp_rank · pp + pp_rank, so the ranks of one pipeline are neighbours (on one machine,
with torchrun's usual numbering). Without torchrun (plain ``python train.py``) we make a one-rank
group, so the same code path, torch's schedules included, runs in a single process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..costs.devices import keep_freed_memory
from ..errors import AutopipeError
from .comm import Comm, checking_requested
from .peak import PeakMemory

__all__ = ["DistEnv", "init_dist", "rank_device", "to_device"]


def rank_device(local_rank: int | None = None) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) when GPUs are visible, else the CPU.

    One GPU per process: with more local ranks than GPUs NCCL would put two ranks on one GPU,
    which it refuses, so that is an error here rather than a hang later.
    """
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise AutopipeError(
            f"local rank {local_rank} has no GPU of its own ({count} visible); launch at most {count} "
            "processes per node (torchrun --nproc-per-node), one per GPU."
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def to_device(tree: Any, device: torch.device) -> Any:
    """Every tensor of ``tree`` on ``device``: pinned host memory and a non-blocking copy to a GPU,
    so the copy overlaps with the work already queued; unchanged when already there."""

    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.device == device:
            return v
        if device.type == "cuda" and v.device.type == "cpu":
            return v.pin_memory().to(device, non_blocking=True)
        return v.to(device)

    return pytree.tree_map(move, tree)


@dataclass
class DistEnv:
    """Where this process sits: its ranks, device and the groups it talks over."""

    rank: int
    world: int
    dp_size: int
    pp_size: int
    device: torch.device
    mesh: Any  # DeviceMesh with dims ("dp", "pp")
    pp_group: Any
    dp_group: Any
    comm: Comm  # the runtime's collectives, on ``device``
    peak: PeakMemory  # per-step peak memory above the baseline taken before the model was built
    tied_groups: dict[str, Any] = field(default_factory=dict)  # tied tensor name -> group (holders only)

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp_size

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp_size

    def global_rank(self, dp_rank: int, pp_rank: int) -> int:
        return dp_rank * self.pp_size + pp_rank

    def make_tied_groups(self, tied: list[Any]) -> None:
        """One group per tied tensor per replica, over exactly the pipeline ranks holding a copy.

        ``new_group`` is collective over the world, so every rank creates every group in the same
        order, also the groups it is not in.
        """
        for spec in tied:
            if len(spec.holders) < 2:
                continue
            for d in range(self.dp_size):
                ranks = [self.global_rank(d, h) for h in spec.holders]
                group = self.comm.new_group(ranks)
                if self.rank in ranks:
                    self.tied_groups[spec.name] = group

    def to_device(self, tree: Any) -> Any:
        """``tree``'s tensors on this rank's device (see :func:`to_device`)."""
        return to_device(tree, self.device)

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        """Leave together, then tear the process group down (no rank exits mid-collective)."""
        if dist.is_initialized():
            self.comm.barrier()
            dist.destroy_process_group()


def init_dist(
    *, dp: int = 1, backend: str | None = None, timeout_s: float = 600, check: bool | None = None
) -> DistEnv:
    """Join (or make) the process group and lay the world out as dp × pp.

    Under torchrun the environment (RANK, WORLD_SIZE, MASTER_ADDR...) says who we are; otherwise
    this process is the whole world. ``check`` turns on the collectives' checking mode (default:
    ``AUTOPIPE_CHECK=1`` in the environment; see :mod:`autopipe.runtime.comm`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    device = rank_device()  # before the process group: NCCL binds to the current GPU
    if device.type == "cpu":
        keep_freed_memory()  # else each step page-faults its activations back in (~20% on CPU)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    bind = {"device_id": device} if device.type == "cuda" else {}
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **bind)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bind
            )
    world = dist.get_world_size()
    if dp < 1 or world % dp:
        raise AutopipeError(
            f"data-parallel size {dp} does not divide the world size {world}; launch dp × stages "
            f"processes (e.g. torchrun --nproc-per-node {dp * max(1, world // max(dp, 1))})."
        )
    pp = world // dp
    mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    return DistEnv(
        rank=dist.get_rank(),
        world=world,
        dp_size=dp,
        pp_size=pp,
        device=device,
        mesh=mesh,
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        comm=Comm(device, checking=checking_requested() if check is None else check),
        peak=PeakMemory(device),
    )
