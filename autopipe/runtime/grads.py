"""After the schedule's backward: tied-gradient sums, data-parallel averaging, global norm clipping.

torch.distributed.pipelining gives each stage its own copy of a tied tensor (GPT-2's wte/lm_head)
and never syncs them; each copy gets only its own layer's gradient. Summing those gradients across
exactly the ranks holding a copy gives every copy the full gradient, so identical optimizer steps
keep the copies equal (DeepSpeed's TiedLayerSpec does the same all-reduce).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["all_finite", "average_dp_grads", "clip_grads_", "global_grad_norm", "sync_tied_grads"]


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    out = []
    for p in params:
        if p.grad is None:  # a parameter this step did not reach still takes part in collectives
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


def sync_tied_grads(params: Mapping[str, nn.Parameter], tied_here: Iterable[Any], groups: Mapping[str, Any]) -> None:
    """Sum each tied tensor's gradient over the ranks holding a copy (same order on every rank)."""
    for spec in tied_here:
        group = groups.get(spec.name)
        if group is None:
            continue
        (grad,) = _grads([params[spec.name]])
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)


def average_dp_grads(params: Mapping[str, nn.Parameter], group: Any, dp_size: int) -> None:
    """Average gradients over data-parallel replicas, as one flat buffer (one collective)."""
    if dp_size == 1:
        return
    grads = _grads(params.values())
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.div_(dp_size)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(
    params: Mapping[str, nn.Parameter], counted_elsewhere: set[str], pp_group: Any | None
) -> float:
    """The 2-norm of the whole model's gradient, each tied tensor counted once.

    Each pipeline rank sums squares over its own parameters, leaving out tied copies another rank
    counts (``counted_elsewhere``); one all-reduce over the pipeline gives the total. Replicas hold
    equal gradients after averaging, so the pipeline group suffices.
    """
    grads = _grads(p for n, p in params.items() if n not in counted_elsewhere)
    local = torch.zeros((), dtype=torch.float64)
    for g in grads:
        local += g.detach().double().pow(2).sum()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=pp_group)
    return math.sqrt(float(local))


def clip_grads_(params: Iterable[nn.Parameter], total_norm: float, max_norm: float) -> None:
    """Scale gradients so their global norm is at most ``max_norm`` (torch's formula)."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return
    coef = min(1.0, max_norm / (total_norm + 1e-6))
    if coef < 1.0:
        for g in _grads(params):
            g.mul_(coef)


def all_finite(params: Iterable[nn.Parameter], group: Any | None = None) -> bool:
    """Whether every gradient on every rank is finite (fp16 loss scaling skips the step if not)."""
    bad = torch.zeros((), dtype=torch.float32)
    for g in _grads(params):
        if not bool(torch.isfinite(g).all()):
            bad.fill_(1.0)
            break
    if dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    return bool(bad == 0)
