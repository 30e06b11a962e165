"""Batches cut into micro-batches, packed for the first chunk, and counted in tokens."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...errors import AutopipeError

__all__ = ['batch_tokens', 'pack_batch', 'split_batch']


def split_batch(args: Sequence[Any], kwargs: dict[str, Any] | None, n: int) -> list[tuple[tuple, dict]]:
    """Cut every tensor of a batch into ``n`` micro-batches along dim 0 (non-tensors are repeated)."""
    leaves, spec = pytree.tree_flatten((tuple(args), dict(kwargs or {})))
    pieces: list[list[Any]] = [[] for _ in range(n)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            if leaf.shape[0] % n:
                raise AutopipeError(
                    f"a batch of {leaf.shape[0]} rows cannot be cut into {n} equal micro-batches; "
                    "use a batch size that is a multiple of --microbatches."
                )
            for i, part in enumerate(leaf.chunk(n)):
                pieces[i].append(part)
        else:
            for i in range(n):
                pieces[i].append(leaf)
    return [pytree.tree_unflatten(p, spec) for p in pieces]


def pack_batch(seq: Any, args: Sequence[Any], kwargs: dict[str, Any] | None, n: int) -> tuple[torch.Tensor, ...]:
    """The first chunk's input for a whole batch: each micro-batch packed, then stacked along dim 0,
    so the schedule's own dim-0 split hands each micro-batch its packed tuple."""
    packed = [seq.pack_inputs(a, k) for a, k in split_batch(args, kwargs, n)]
    return tuple(torch.cat(parts, dim=0) for parts in zip(*packed))


def batch_tokens(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> int:
    """Tokens in a batch: elements of the first integer tensor argument (samples if none)."""
    for v in [*args, *(kwargs or {}).values()]:
        if isinstance(v, torch.Tensor) and not v.is_floating_point():
            return v.numel()
    for v in [*args, *(kwargs or {}).values()]:
        if isinstance(v, torch.Tensor):
            return int(v.shape[0]) if v.dim() else 1
    return 0
