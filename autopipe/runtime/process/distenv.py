"""Where each rank runs: its device, a (dp, pp[, tp]) DeviceMesh over the world, one group per tied tensor.

The device is decided here and nowhere else (``rank_device``): ``LOCAL_RANK`` -> ``cuda:LOCAL_RANK``
when GPUs are visible, ``cuda:0`` when the process sees exactly one (SLURM's ``--gpus-per-task=1``
gives each rank its own GPU as device 0), made current before the process group exists and given
to it as ``device_id`` so NCCL binds its communicator to that GPU at once; else the CPU with gloo.
Every other module takes ``DistEnv.device``; batches reach it through ``to_device`` (pinned,
non-blocking copies on a GPU); collectives go through ``DistEnv.comm`` (:mod:`autopipe.runtime.process.comm`).

The plan's placement numbers the ranks (``autopipe.choices.world_rank``): ``pipeline-inner`` (the
default) makes global rank = dp_rank · pp + pp_rank, so the ranks of one pipeline are neighbours;
``replica-inner`` makes it pp_rank · dp + dp_rank, so the replicas of one stage are (and their
gradient reduction stays inside a node). With tensor parallelism (``tp`` > 1) each of those ranks
becomes ``tp`` consecutive ranks, tp innermost (``world_rank(..., tp=, tp_rank=)``): a stage's tp
group shares a node, and the mesh is ("dp", "pp", "tp"). torchrun fills each node with consecutive ranks. Without
torchrun (plain ``python train.py``) we make a one-rank group, so the same code path, torch's
schedules included, runs in a single process.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ...choices import PLACEMENTS, world_rank
from ...costs.devices import keep_freed_memory, steady_heap
from ...errors import AutopipeError
from ..logs.peak import PeakMemory
from .comm import Comm, checking_requested
from .lifecycle import watch_peers

__all__ = ["DistEnv", "init_dist", "rank_device", "to_device"]


def rank_device(local_rank: int | None = None) -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` (made current) when GPUs are visible, ``cuda:0`` when
    exactly one is (one GPU per process, whatever the local rank), else the CPU.

    One GPU per process: with more local ranks than GPUs NCCL would put two ranks on one GPU,
    which it refuses, so that is an error here rather than a hang later (and, with one GPU seen by
    several local ranks, in ``init_dist`` once the ranks can compare their GPUs).
    """
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:  # SLURM --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per rank: this one is ours
        index = 0
    elif local_rank < count:
        index = local_rank
    else:
        raise AutopipeError(
            f"local rank {local_rank} has no GPU of its own ({count} visible); launch at most {count} "
            "processes per node (torchrun --nproc-per-node), one per GPU."
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _check_own_gpu(device: torch.device) -> None:
    """Refuse two local ranks on one GPU: each rank that sees a single GPU (``rank_device`` took
    cuda:0) posts its GPU's UUID in the store and reads its node's others'. NCCL would refuse the
    pair at the first collective, with a traceback on every rank."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if device.type != "cuda" or local_world < 2 or torch.cuda.device_count() != 1:
        return
    store = dist.distributed_c10d._get_default_store()
    node, local = os.environ.get("GROUP_RANK", "0"), int(os.environ.get("LOCAL_RANK", "0"))
    mine = str(torch.cuda.get_device_properties(device).uuid)
    store.set(f"autopipe/gpu/{node}/{local}", mine)
    keys = [f"autopipe/gpu/{node}/{r}" for r in range(local_world)]
    store.wait(keys)
    for r, key in enumerate(keys):
        if r != local and store.get(key).decode() == mine:
            raise AutopipeError(
                f"local ranks {min(r, local)} and {max(r, local)} both see only GPU {mine} as their device; give each "
                "process its own GPU (SLURM --gpus-per-task=1, or one process per GPU: torchrun --nproc-per-node = GPUs)."
            )


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
    mesh: Any  # DeviceMesh with dims ("dp", "pp"), or ("dp", "pp", "tp") when tp > 1
    pp_group: Any
    dp_group: Any
    comm: Comm  # the runtime's collectives, on ``device``
    peak: PeakMemory  # per-step peak memory above the baseline taken before the model was built
    tied_groups: dict[str, Any] = field(default_factory=dict)  # tied tensor name -> group (holders only)
    placement: str = "pipeline-inner"  # how ranks are numbered (autopipe.choices.PLACEMENTS)
    watch: Any = None  # the peer watch's stop event (autopipe.runtime.process.lifecycle.watch_peers)
    tp_size: int = 1  # tensor-parallel ranks per stage (innermost)
    tp_group: Any = None  # this stage's tp ranks (None when tp_size is 1)
    # the group over which one replica's gradient norm is summed: its pipeline, and its tp ranks
    pp_tp_group: Any = None
    # expert parallelism (Plan.ep): a stage's ep consecutive dp ranks share its experts out; the
    # expert data-parallel group holds this rank's experts in the other ep groups (None when dp = ep);
    # the norm group is the pipelines of this rank's ep group (autopipe.runtime.stage.expert_parallel)
    ep_size: int = 1
    ep_group: Any = None
    expert_dp_group: Any = None
    pp_ep_group: Any = None

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def dp_rank(self) -> int:
        q = self.rank // self.tp_size
        return q // self.pp_size if self.placement == "pipeline-inner" else q % self.dp_size

    @property
    def pp_rank(self) -> int:
        q = self.rank // self.tp_size
        return q % self.pp_size if self.placement == "pipeline-inner" else q // self.dp_size

    @property
    def tp_mesh(self) -> Any:
        """The 1-D mesh of this stage's tp ranks (None without tensor parallelism)."""
        return self.mesh["tp"] if self.tp_size > 1 else None

    def global_rank(self, dp_rank: int, pp_rank: int, tp_rank: int | None = None) -> int:
        """The world rank of replica ``dp_rank``'s stage ``pp_rank`` (its tp rank ``tp_rank``, default this rank's)."""
        return world_rank(dp_rank, pp_rank, dp=self.dp_size, pp=self.pp_size, placement=self.placement,
                          tp=self.tp_size, tp_rank=self.tp_rank if tp_rank is None else tp_rank)

    def pipeline_ranks(self, dp_rank: int = 0) -> list[int]:
        """The world ranks of replica ``dp_rank``'s stages, in stage order (at this rank's tp rank)."""
        return [self.global_rank(dp_rank, p) for p in range(self.pp_size)]

    def make_tied_groups(self, tied: list[Any]) -> None:
        """One group per tied tensor per replica, over exactly the pipeline ranks holding a copy.

        ``new_group`` is collective over the world, so every rank creates every group in the same
        order, also the groups it is not in.
        """
        for spec in tied:
            if len(spec.holders) < 2:
                continue
            for d in range(self.dp_size):
                for t in range(self.tp_size):  # tp rank t of every holder keeps the same shard
                    ranks = [self.global_rank(d, h, t) for h in spec.holders]
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
            if self.watch is not None:  # from here on the store goes away: not a failed peer
                self.watch.set()
            dist.destroy_process_group()


def init_dist(
    *, dp: int = 1, placement: str = "pipeline-inner", backend: str | None = None, timeout_s: float = 600,
    check: bool | None = None, exact_memory: bool | None = None, tp: int = 1, ep: int = 1,
) -> DistEnv:
    """Join (or make) the process group and lay the world out as dp × pp, numbered by ``placement``.

    Under torchrun the environment (RANK, WORLD_SIZE, MASTER_ADDR...) says who we are; otherwise
    this process is the whole world. ``placement`` is the plan's (``Plan.placement``): which ranks
    form a pipeline and which the replicas of a stage. ``check`` turns on the collectives' checking
    mode (default: ``AUTOPIPE_CHECK=1`` in the environment; see :mod:`autopipe.runtime.process.comm`).
    ``exact_memory`` (default: ``AUTOPIPE_EXACT_MEMORY=1`` in the environment) makes a CPU rank's
    resident peak count its tensors, as the plan does, at a price in time
    (``autopipe.costs.devices.keep_freed_memory``); a GPU's allocator counts them anyway.
    ``tp``: tensor-parallel ranks per stage (``Plan.tp``), innermost: world = dp × stages × tp, a
    stage's tp ranks consecutive and inside one node. ``ep``: expert-parallel degree (``Plan.ep``),
    dividing dp: each stage's ep consecutive replicas form an ep group.

    Example (16 ranks as 8 stages x 2 replicas; torch's fake backend stands in for 16 processes):
        >>> from torch.testing._internal.distributed.fake_pg import FakeStore
        >>> dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=16)
        >>> env = init_dist(dp=2, placement="replica-inner")
        >>> env.pp_rank, env.dp_rank, dist.get_process_group_ranks(env.dp_group)
        (1, 1, [2, 3])
        >>> dist.destroy_process_group()
        >>> dist.init_process_group("fake", store=FakeStore(), rank=13, world_size=16)
        >>> env = init_dist(dp=2, tp=2)   # 2 replicas x 4 stages x 2 tp ranks
        >>> env.dp_rank, env.pp_rank, env.tp_rank, dist.get_process_group_ranks(env.tp_group)
        (1, 2, 1, [12, 13])
        >>> dist.get_process_group_ranks(env.pp_group), dist.get_process_group_ranks(env.dp_group)
        ([9, 11, 13, 15], [5, 13])
        >>> dist.destroy_process_group()
    """
    if placement not in PLACEMENTS:
        raise AutopipeError(f"unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}.")
    device = rank_device()  # before the process group: NCCL binds to the current GPU
    if exact_memory is None:
        exact_memory = os.environ.get("AUTOPIPE_EXACT_MEMORY", "") not in ("", "0")
    if device.type == "cpu" and exact_memory:
        keep_freed_memory()  # the resident peak then measures the tensors; each step page-faults its large ones
    elif device.type == "cpu":
        steady_heap()  # each step reuses the last one's heap pages, as the profile timed them
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    bind = {"device_id": device} if device.type == "cuda" else {}
    watch = None
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout, **bind)
            _check_own_gpu(device)  # before any collective: NCCL's would fail first, less clearly
            # every rank has finished joining before any can fail and leave: a rank leaving while
            # another is still inside init_process_group gave that one a raw "Connection closed by
            # peer" there, before the store that carries the failed rank's one line was usable
            Comm(device).barrier()
            watch = watch_peers()  # a rank that fails makes the others leave, even from inside a collective
        else:
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout, **bind
            )
    world = dist.get_world_size()
    if world == 1:  # one process runs every stage, whole (as it runs any plan's stages in turn)
        tp = 1
    check_tp(tp, world, local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if dp < 1 or world % (dp * tp):
        raise AutopipeError(
            f"data-parallel size {dp}{f' x tp {tp}' if tp > 1 else ''} does not divide the world size {world}; launch "
            f"dp × stages{' × tp' if tp > 1 else ''} processes (e.g. torchrun --nproc-per-node "
            f"{dp * tp * max(1, world // max(dp * tp, 1))})."
        )
    pp = world // (dp * tp)
    from torch.distributed.device_mesh import DeviceMesh

    if tp > 1:  # mesh[d, p, t] is the world rank of replica d's stage p, tp rank t
        ranks = torch.tensor([[[world_rank(d, p, dp=dp, pp=pp, placement=placement, tp=tp, tp_rank=t) for t in range(tp)]
                               for p in range(pp)] for d in range(dp)])
        mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("dp", "pp", "tp"))
    elif placement == "pipeline-inner":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    else:  # mesh[d, p] is the world rank of replica d's stage p
        ranks = torch.tensor([[world_rank(d, p, dp=dp, pp=pp, placement=placement) for p in range(pp)] for d in range(dp)])
        mesh = DeviceMesh(device.type, ranks, mesh_dim_names=("dp", "pp"))
    comm = Comm(device, checking=checking_requested() if check is None else check)
    pp_tp_group = None
    if tp > 1:  # one group per replica over its pipeline and tp ranks (new_group is collective: all, in order)
        for d in range(dp):
            ranks_d = sorted(world_rank(d, p, dp=dp, pp=pp, placement=placement, tp=tp, tp_rank=t)
                             for p in range(pp) for t in range(tp))
            group = comm.new_group(ranks_d)
            if dist.get_rank() in ranks_d:
                pp_tp_group = group
    groups = _ep_groups(ep, dp, pp, tp, placement, comm) if world > 1 else (None, None, None)
    return DistEnv(
        rank=dist.get_rank(),
        world=world,
        dp_size=dp,
        pp_size=pp,
        device=device,
        mesh=mesh,
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        comm=comm,
        peak=PeakMemory(device),
        placement=placement,
        watch=watch,
        tp_size=tp,
        tp_group=mesh.get_group("tp") if tp > 1 else None,
        pp_tp_group=pp_tp_group,
        ep_size=ep if world > 1 else 1,
        ep_group=groups[0],
        expert_dp_group=groups[1],
        pp_ep_group=groups[2],
    )


def _ep_groups(ep: int, dp: int, pp: int, tp: int, placement: str, comm: Comm) -> tuple[Any, Any, Any]:
    """This rank's ep group, expert data-parallel group and pp x ep norm group (``new_group`` is
    collective: every rank makes every group, in the same order).

    With tp, a MoE layer runs replicated over its tp ranks (its experts call is no DTensor op), so
    each tp rank dispatches among the replicas at its own tp rank: ep and expert data-parallel groups
    per (stage, tp rank). The norm group of an ep group holds its tp ranks too (tp shards are
    counted on each, what tp replicates on tp rank 0)."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or dp % ep:
        raise AutopipeError(f"--ep {ep} must divide --dp {dp}: the experts are shared out over ep of a stage's "
                            "replicas; pick an ep that divides dp (or --ep 1).")
    if ep == 1:
        return None, None, None
    me = dist.get_rank()
    found: list[Any] = [None, None, None]

    def rank(d: int, p: int, t: int = 0) -> int:
        return world_rank(d, p, dp=dp, pp=pp, placement=placement, tp=tp, tp_rank=t)

    for p in range(pp):
        for t in range(tp):
            for g in range(dp // ep):
                ranks = [rank(g * ep + j, p, t) for j in range(ep)]
                group = comm.new_group(ranks)
                found[0] = group if me in ranks else found[0]
            if dp > ep:
                for j in range(ep):
                    ranks = [rank(g * ep + j, p, t) for g in range(dp // ep)]
                    group = comm.new_group(ranks)
                    found[1] = group if me in ranks else found[1]
    for g in range(dp // ep):
        ranks = sorted(rank(g * ep + j, p, t) for p in range(pp) for j in range(ep) for t in range(tp))
        group = comm.new_group(ranks)
        found[2] = group if me in ranks else found[2]
    return found[0], found[1], found[2]


def check_tp(tp: int, world: int, *, local_world: int) -> None:
    """One line when ``tp`` cannot lay out: not a whole number, not dividing the world, or more tp
    ranks than one node holds (a tp group's per-layer collectives must stay on a node's links).

    >>> check_tp(3, 8, local_world=8)
    Traceback (most recent call last):
    ...
    autopipe.errors.AutopipeError: tp 3 does not divide the world of 8 ranks; launch stages x dp x tp processes, or pick a tp that divides it (2, 4, 8).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise AutopipeError(f"tp {tp!r} is not a whole number of ranks; give --tp 1, 2, 4 or 8.")
    if tp == 1:
        return
    if world % tp:
        fits = ", ".join(str(t) for t in range(2, world + 1) if world % t == 0)
        raise AutopipeError(f"tp {tp} does not divide the world of {world} ranks; launch stages x dp x tp processes, "
                            f"or pick a tp that divides it ({fits}).")
    if tp > local_world or local_world % tp:
        raise AutopipeError(f"tp {tp} does not fit the {local_world} processes (GPUs) of a node: a stage's tp ranks "
                            f"must share one node; use a tp that divides {local_world}.")
