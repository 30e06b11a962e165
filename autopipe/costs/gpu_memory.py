"""What a training process holds on a GPU beyond its tensors, per GPU, each figure with its source. No torch.

The memory model (:mod:`autopipe.planner.memory`) adds up the tensors a rank holds. On a GPU the
process holds more, and a plan that leaves it out says "fits" and runs out of memory:

| term | what it is | where it lives |
| --- | --- | --- |
| ``context`` | the CUDA context: the driver's state and the kernels loaded so far | outside torch's allocator |
| ``workspace`` | cuBLAS/cuBLASLt workspaces, one per (handle, stream) pair | inside torch's allocator |
| ``nccl_group`` / ``nccl_pair`` | one NCCL communicator's buffers (its channels' ring/tree connections), for a group of more than two ranks / of two | outside the allocator |
| ``nccl_peer`` | point-to-point buffers to one pipeline neighbour, over the group's communicator | outside the allocator |
| ``slack`` | reserved but free memory of torch's caching allocator (rounding, split blocks), as a share of the tensors' peak | inside the allocator |

Each figure below says whether it is **published** (a default documented or written in the
source of the library that allocates it), **reported** (measured by others, cited) or **assumed**
(our estimate, to be replaced by a measurement: ``autopipe doctor`` prints the gap on the GPU it
runs on, and a measured profile carries the runtime reserve, :mod:`autopipe.runtime.checks.reserve`, which
absorbs what the model leaves out). The optimizer step's temporaries are the memory model's own
term (:func:`autopipe.planner.memory.layer_memory`), from torch's code, not a per-GPU figure.

Example:
    >>> h100 = CUDA_MEMORY["h100"]
    >>> h100.workspace.bytes >> 20, h100.workspace.source
    (64, 'published')
    >>> sorted({f.source for f in h100.figures().values()})
    ['assumed', 'published', 'reported']
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["Figure", "CudaMemory", "CUDA_MEMORY", "cuda_memory", "EXPANDABLE_SLACK", "expandable_segments"]

_MIB = 1 << 20


@dataclass(frozen=True)
class Figure:
    """One figure of the model: ``bytes`` (or, for the slack, a share as ``ratio``), its ``source``
    (published, reported, assumed or measured) and where it comes from."""

    source: str
    why: str
    bytes: int = 0
    ratio: float = 0.0


# ---- the figures, with where each comes from ---------------------------------------------------

# torch 1.13+ sets CUDA_MODULE_LOADING=LAZY (pytorch/pytorch#86509): a context then measured 287 MB
# after one small op; 300-400 MB is what PyTorch's maintainers quote for it (pytorch#107667, #109888).
# A training step loads many more kernels (backward, optimizer, NCCL's): assumed 512 MiB.
_CONTEXT = Figure("assumed", "CUDA context with lazy module loading: 287-400 MB reported for a few kernels "
                  "(pytorch/pytorch#86509, #109888); a training step loads more", bytes=512 * _MIB)

# torch's default cuBLAS workspace per (handle, stream): CUBLAS_WORKSPACE_CONFIG ":4096:8" = 32 MiB on
# sm90 (the size cuBLAS's documentation asks for on Hopper), ":4096:2:16:8" = 8 MiB + 128 KiB before
# (aten/src/ATen/cuda/CublasHandlePool.cpp); cuBLASLt shares it. Two handles use the step's stream:
# the training thread's and autograd's backward thread's (assumed count).
_HOPPER_WORKSPACE = Figure("published", "torch's cuBLAS workspace on sm90, 32 MiB per (handle, stream), "
                           "x2: the training thread and autograd's backward thread", bytes=2 * 32 * _MIB)
_AMPERE_WORKSPACE = Figure("published", "torch's cuBLAS workspace before sm90, 8 MiB + 128 KiB per "
                           "(handle, stream), x2: the training thread and autograd's backward thread",
                           bytes=2 * (8 * _MIB + 128 * 1024))

# NVIDIA/nccl#964: on 4 A100s with NVLink, each new group running a 4 MB all-reduce took 544 MB
# (2 ranks) or 688 MB (more); NCCL's memory grows linearly with its channels (NVIDIA/nccl#864,
# #986). NCCL 2.22+ connects algorithms on first use, so a communicator used for small collectives
# only may hold less: the figures are an upper reading until the doctor measures them here.
_GROUP = Figure("reported", "one NCCL communicator over more than 2 ranks: 688 MB measured on A100/NVLink "
                "(NVIDIA/nccl#964)", bytes=688 * _MIB)
_PAIR = Figure("reported", "one NCCL communicator over 2 ranks: 544 MB measured on A100/NVLink "
               "(NVIDIA/nccl#964)", bytes=544 * _MIB)

# Point-to-point to a pipeline neighbour: torch sends over the group's own communicator when the
# process group is bound to a device (autopipe passes device_id), and NCCL allocates P2P buffers per
# channel and peer: 10 MiB + 2 MiB per channel as logged for P2P on 8 H100s (NVIDIA/nccl#1685);
# 8 channels per peer assumed.
_PEER = Figure("assumed", "point-to-point buffers to one pipeline neighbour: 8 channels x 12 MiB "
               "(per-channel buffers as NCCL logged them on H100, NVIDIA/nccl#1685)", bytes=96 * _MIB)

# The caching allocator rounds requests (512 B; 2 MiB blocks above 1 MiB) and splits cached
# segments; what stays reserved but free is typically a tenth of the peak or more: assumed 10 %.
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True grows segments in place instead: assumed 2 %.
_SLACK = Figure("assumed", "torch's caching allocator: reserved but free memory at the peak (rounding, "
                "split cached blocks)", ratio=0.10)
EXPANDABLE_SLACK = Figure("assumed", "torch's caching allocator with expandable_segments:True", ratio=0.02)


@dataclass(frozen=True)
class CudaMemory:
    """What one training process holds on one GPU of a kind beyond its tensors (module docstring)."""

    gpu: str
    context: Figure
    workspace: Figure
    nccl_group: Figure
    nccl_pair: Figure
    nccl_peer: Figure
    slack: Figure

    def figures(self) -> dict[str, Figure]:
        """Term name -> figure, in the table's order."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "gpu"}

    def device_fields(self) -> dict[str, float]:
        """The figures as ``DeviceInfo`` carries them in a profile (``*_bytes``, ``allocator_slack``)."""
        return dict(context_bytes=self.context.bytes, workspace_bytes=self.workspace.bytes,
                    nccl_group_bytes=self.nccl_group.bytes, nccl_pair_bytes=self.nccl_pair.bytes,
                    nccl_peer_bytes=self.nccl_peer.bytes, allocator_slack=self.slack.ratio)  # fmt: skip

    def with_expandable_segments(self) -> "CudaMemory":
        """The same GPU under ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``."""
        from dataclasses import replace

        return replace(self, slack=EXPANDABLE_SLACK)


CUDA_MEMORY: dict[str, CudaMemory] = {
    "a100": CudaMemory("NVIDIA A100", _CONTEXT, _AMPERE_WORKSPACE, _GROUP, _PAIR, _PEER, _SLACK),
    "h100": CudaMemory("NVIDIA H100", _CONTEXT, _HOPPER_WORKSPACE, _GROUP, _PAIR, _PEER, _SLACK),
    "h200": CudaMemory("NVIDIA H200", _CONTEXT, _HOPPER_WORKSPACE, _GROUP, _PAIR, _PEER, _SLACK),
    # any other CUDA GPU: the pre-Hopper workspace (the smaller), the same assumptions otherwise
    "cuda": CudaMemory("other CUDA GPU", _CONTEXT, _AMPERE_WORKSPACE, _GROUP, _PAIR, _PEER, _SLACK),
}


def cuda_memory(gpu_name: str, *, expandable_segments: bool = False, hopper: bool | None = None) -> CudaMemory:
    """The figures for a GPU by its name (``NVIDIA H100 80GB HBM3`` -> h100's); an unknown one gets
    the ``cuda`` row, or Hopper's workspace when ``hopper`` (compute capability 9) says so.

    >>> cuda_memory("NVIDIA H100 80GB HBM3").gpu, cuda_memory("Tesla T4").gpu
    ('NVIDIA H100', 'other CUDA GPU')
    >>> cuda_memory("NVIDIA A100-SXM4-80GB", expandable_segments=True).slack.ratio
    0.02
    """
    name = gpu_name.lower()
    row = next((row for key, row in CUDA_MEMORY.items() if key != "cuda" and key in name), None)
    if row is None:
        row = CUDA_MEMORY["cuda"]
        if hopper:
            from dataclasses import replace

            row = replace(row, workspace=_HOPPER_WORKSPACE)
    return row.with_expandable_segments() if expandable_segments else row


def expandable_segments(alloc_conf: str) -> bool:
    """Whether a ``PYTORCH_CUDA_ALLOC_CONF`` value turns expandable segments on.

    >>> expandable_segments("max_split_size_mb:128,expandable_segments:True"), expandable_segments("")
    (True, False)
    """
    settings = dict(part.split(":", 1) for part in alloc_conf.replace(" ", "").split(",") if ":" in part)
    return settings.get("expandable_segments", "").lower() in ("true", "1")
