"""Process groups: a (dp, pp) DeviceMesh over the world, and one group per tied tensor.

Global rank = dp_rank · pp + pp_rank, so the ranks of one pipeline are neighbours (on one machine,
with torchrun's usual numbering). Without torchrun (plain ``python train.py``) we make a one-rank
gloo group, so the same code path, torch's schedules included, runs in a single process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..devices import keep_freed_memory
from ..errors import AutopipeError

__all__ = ["DistEnv", "default_device", "init_dist"]


def default_device(local_rank: int = 0) -> torch.device:
    """This rank's accelerator if there is one, else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.tied_groups[spec.name] = group

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Leave together, then tear the process group down (no rank exits mid-collective)."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def init_dist(*, dp: int = 1, backend: str | None = None, timeout_s: float = 600) -> DistEnv:
    """Join (or make) the process group and lay the world out as dp × pp.

    Under torchrun the environment (RANK, WORLD_SIZE, MASTER_ADDR...) says who we are; otherwise
    this process is the whole world.
    """
    from torch.distributed.device_mesh import init_device_mesh

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = default_device(local_rank)
    if device.type == "cpu":
        keep_freed_memory()  # else each step page-faults its activations back in (~20% on CPU)
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
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
    )
