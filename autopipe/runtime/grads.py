"""After the schedule's backward: tied-gradient sums, data-parallel averaging, global norm clipping.

torch.distributed.pipelining gives each stage its own copy of a tied tensor (GPT-2's wte/lm_head)
and never syncs them; each copy gets only its own layer's gradient. Summing those gradients across
exactly the ranks holding a copy gives every copy the full gradient, so identical optimizer steps
keep the copies equal (DeepSpeed's TiedLayerSpec does the same all-reduce).

Everything here stays on the gradients' device: the norm is a device tensor and the clip scales by
a device tensor, so a step never waits for the GPU here (the trainer reads the norm once, with the
step's other figures). Collectives go through :class:`~autopipe.runtime.comm.Comm`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .comm import Comm

__all__ = ["average_dp_grads", "clip_grads_", "global_grad_norm", "sync_tied_grads"]


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    out = []
    for p in params:
        if p.grad is None:  # a parameter this step did not reach still takes part in collectives
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


def sync_tied_grads(
    params: Mapping[str, nn.Parameter], tied_here: Iterable[Any], groups: Mapping[str, Any], comm: Comm
) -> None:
    """Sum each tied tensor's gradient over the ranks holding a copy (same order on every rank)."""
    for spec in tied_here:
        group = groups.get(spec.name)
        if group is None:
            continue
        (grad,) = _grads([params[spec.name]])
        comm.all_reduce(grad, group=group, where=f"tied gradient {spec.name}")


def average_dp_grads(params: Mapping[str, nn.Parameter], group: Any, dp_size: int, comm: Comm) -> None:
    """Average gradients over data-parallel replicas, as one flat buffer (one collective)."""
    if dp_size == 1:
        return
    grads = _grads(params.values())
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group, where="data-parallel gradients")
    flat.div_(dp_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(
    params: Mapping[str, nn.Parameter], counted_elsewhere: set[str], pp_group: Any | None, comm: Comm
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, each tied tensor counted once (float64, on the device).

    Each pipeline rank sums squares over its own parameters, leaving out tied copies another rank
    counts (``counted_elsewhere``); one all-reduce over the pipeline gives the total. Replicas hold
    equal gradients after averaging, so the pipeline group suffices.
    """
    grads = _grads(p for n, p in params.items() if n not in counted_elsewhere)
    local = torch.zeros((), dtype=torch.float64, device=comm.device)
    for g in grads:
        local += g.detach().double().pow(2).sum()
    comm.all_reduce(local, group=pp_group, where="gradient norm")
    return local.sqrt()


def clip_grads_(params: Iterable[nn.Parameter], total_norm: torch.Tensor | float, max_norm: float) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's formula).

    The factor min(1, max_norm / (norm + 1e-6)) is applied on the device whatever its value
    (multiplying by exactly 1.0 changes nothing), so no branch needs the norm on the host.
    """
    if max_norm <= 0:
        return
    grads = _grads(params)
    if not grads:
        return
    norm = torch.as_tensor(total_norm, dtype=torch.float64, device=grads[0].device)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
