"""After the schedule's backward: tied-gradient sums, global norm clipping.

Averaging over data-parallel replicas is not here: the engines of :mod:`autopipe.runtime.torch_engine.zero`
(DDP, ``replicate``, FSDP2) reduce inside the schedule, bucket by bucket. What is here works on each
rank's local part of a gradient (a sharded DTensor's shard), so it holds in every ZeRO stage.

torch.distributed.pipelining gives each stage its own copy of a tied tensor (GPT-2's wte/lm_head)
and never syncs them; each copy gets only its own layer's gradient. Summing those gradients across
exactly the ranks holding a copy gives every copy the full gradient, so identical optimizer steps
keep the copies equal (DeepSpeed's TiedLayerSpec does the same all-reduce).

Everything here stays on the gradients' device: the norm is a device tensor and the clip scales by
a device tensor, so a step never waits for the GPU here (the trainer reads the norm once, with the
step's other figures). Collectives go through :class:`~autopipe.runtime.process.comm.Comm`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..process.comm import Comm
from ..stage.build import local

__all__ = ["clip_grads_", "global_grad_norm", "sync_tied_grads", "zero_grads_"]


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient, this rank's part of it (the local shard of a DTensor)."""
    out = []
    for p in params:
        if p.grad is None:  # a parameter this step did not reach still takes part in collectives
            p.grad = torch.zeros_like(p)
        out.append(local(p.grad))
    return out


def sync_tied_grads(
    params: Mapping[str, nn.Parameter], tied_here: Iterable[Any], groups: Mapping[str, Any], comm: Comm
) -> None:
    """Sum each tied tensor's gradient over the ranks holding a copy (same order on every rank).

    Under ZeRO 2/3 each copy is sharded over the replicas of its stage; the copies have one shape
    and their stages one replica count, so replica d of every holder keeps the same slice, and
    summing the local slices over the holders of replica d gives that slice of the sum.
    """
    for spec in tied_here:
        group = groups.get(spec.name)
        if group is None:
            continue
        (grad,) = _grads([params[spec.name]])
        comm.all_reduce(grad, group=group, where=f"tied gradient {spec.name}")


def global_grad_norm(
    params: Mapping[str, nn.Parameter], counted_elsewhere: set[str], group: Any | None, comm: Comm
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, each tied tensor counted once (float64, on the device).

    Each rank sums squares over its own parameters (its shards of them), leaving out tied copies
    another pipeline rank counts (``counted_elsewhere``); one all-reduce over ``group`` gives the
    total. ``group``: the pipeline group when replicas hold equal, whole gradients (ZeRO 0/1: summing
    over replicas too would count each R times); the whole world when they hold disjoint shards
    (ZeRO 2/3).
    """
    grads = _grads(p for n, p in params.items() if n not in counted_elsewhere)
    squares = _sum_of_squares(grads, comm.device)
    comm.all_reduce(squares, group=group, where="gradient norm")
    return squares.sqrt()


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ sum(g²) over ``grads`` in float64 (a 0-dim tensor on ``device``), in a few kernels whatever
    the number of tensors.

    ``torch._foreach_norm`` takes every gradient of one dtype in one multi-tensor kernel on a GPU
    (a rank holds thousands: one launch each, three or four times over, was the old way), and with
    ``dtype=float64`` it sums in float64 without a float64 copy of any gradient: the copy and its
    square once held 4x a gradient's bytes, 48 MiB of resident peak for the showcase's 16384 x 192
    embedding, which no term of the plan charges. float32 sums were 1e-5 off on a 1M-element
    gradient; these equal the exact float64 norm (tested to 1e-12).
    """
    total = torch.zeros((), dtype=torch.float64, device=device)
    for same in _by_dtype(grads):
        norms = torch._foreach_norm(same, 2.0, dtype=torch.float64)
        total += torch.stack(norms).square().sum()
    return total


def clip_grads_(params: Iterable[nn.Parameter], total_norm: torch.Tensor | float, max_norm: float) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's formula).

    The factor min(1, max_norm / (norm + 1e-6)) is applied on the device whatever its value
    (multiplying by exactly 1.0 changes nothing), so no branch needs the norm on the host; one
    multi-tensor kernel per dtype, as torch's ``clip_grad_norm_``.
    """
    if max_norm <= 0:
        return
    grads = _grads(params)
    if not grads:
        return
    norm = torch.as_tensor(total_norm, dtype=torch.float64, device=grads[0].device)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for same in _by_dtype(grads):
        torch._foreach_mul_(same, coef.to(same[0].dtype))


def zero_grads_(params: Iterable[nn.Parameter]) -> None:
    """Zero every gradient in place, kept allocated, on its local part (one kernel per dtype): torch's
    ``zero_grad`` refuses a mix of plain tensors and DTensors, which expert parallelism's plain
    expert slices beside ``replicate``'s DTensors are."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    for same in _by_dtype(grads):
        torch._foreach_zero_(same)
