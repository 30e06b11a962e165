"""The partitioners users already know, for comparison with autopipe's optimum. No torch.

Each returns boundaries (``chunks + 1`` layer indices from 0 to L, no empty chunk) from plain numbers:

- ``uniform``: equal layer counts, the first ``L % K`` chunks one layer longer (DeepSpeed's 'uniform').
- ``parameters``: balance parameter counts (DeepSpeed's default 'parameters'). Computed exactly with
  autopipe's own solver, so it is the best that counting parameters can do.
- ``type:REGEX``: balance the number of layers whose name matches REGEX (DeepSpeed's 'type:').
- ``torchtitan``: equal layer counts where the first and last layers (embedding, head) count as
  ``input_weight`` and ``output_weight`` layers; the first ``units % K`` chunks take one unit more.
- ``greedy``: cut where the running time is closest to each multiple of total / K.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

from ..errors import PartitionError
from .bottleneck import solve

__all__ = ["BASELINES", "uniform", "parameters", "by_type", "torchtitan", "greedy", "baseline"]

BASELINES = ("uniform", "parameters", "torchtitan", "greedy")  # type:REGEX needs a pattern


def _fix(bounds: Sequence[int], n: int) -> tuple[int, ...]:
    """Make boundaries strictly increasing from 0 to n (no empty chunk), moving as little as possible."""
    k = len(bounds) - 1
    b = [0] + [int(x) for x in bounds[1:-1]] + [n]
    for s in range(1, k):  # at least s layers before cut s, at least k - s after it
        b[s] = min(max(b[s], b[s - 1] + 1), n - (k - s))
    return tuple(b)


def uniform(num_layers: int, chunks: int) -> tuple[int, ...]:
    """Equal layer counts; the first ``num_layers % chunks`` chunks get one more."""
    base, extra = divmod(num_layers, chunks)
    sizes = [base + (s < extra) for s in range(chunks)]
    return _fix(np.concatenate([[0], np.cumsum(sizes)]).tolist(), num_layers)


def parameters(params: Sequence[float], chunks: int) -> tuple[int, ...]:
    """The cut with the smallest largest parameter count per chunk."""
    return _fix(solve([float(p) for p in params], chunks).boundaries, len(params))


def by_type(names: Sequence[str], pattern: str, chunks: int) -> tuple[int, ...]:
    """Balance the count of layers whose name matches ``pattern`` (re.search, case-insensitive)."""
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as e:
        raise PartitionError(f"type:{pattern} is not a valid regular expression ({e}).") from None
    weights = [1.0 if regex.search(name) else 0.0 for name in names]
    if not any(weights):
        sample = ", ".join(list(names)[:5])
        raise PartitionError(f"type:{pattern} matches no layer name (names look like: {sample}).")
    return _fix(solve(weights, chunks).boundaries, len(names))


def torchtitan(num_layers: int, chunks: int, *, input_weight: int = 1, output_weight: int = 1) -> tuple[int, ...]:
    """torchtitan's split: first/last layer weigh input/output_weight layers, units shared evenly."""
    units = [input_weight] + [1] * max(num_layers - 2, 0) + ([output_weight] if num_layers > 1 else [])
    base, extra = divmod(sum(units), chunks)
    targets = np.cumsum([base + (s < extra) for s in range(chunks)])
    starts = np.concatenate([[0], np.cumsum(units)])  # units before layer i
    bounds = [0] + [int(np.searchsorted(starts, t, side="left")) for t in targets[:-1]] + [num_layers]
    return _fix(bounds, num_layers)


def greedy(times: Sequence[float], chunks: int) -> tuple[int, ...]:
    """Cut where the running time is nearest to s * total / chunks, s = 1 .. chunks - 1."""
    prefix = np.concatenate([[0.0], np.cumsum(times)])
    targets = prefix[-1] * np.arange(1, chunks) / chunks
    right = np.clip(np.searchsorted(prefix, targets), 1, len(times))
    left = right - 1
    nearer_left = np.abs(prefix[left] - targets) <= np.abs(prefix[right] - targets)
    cuts = np.where(nearer_left, left, right)
    return _fix([0, *cuts.tolist(), len(times)], len(times))


def baseline(
    method: str,
    chunks: int,
    *,
    times: Sequence[float],
    params: Sequence[float],
    names: Sequence[str],
) -> tuple[int, ...]:
    """Boundaries of baseline ``method`` ("uniform", "parameters", "type:REGEX", "torchtitan", "greedy")."""
    n = len(times)
    if method == "uniform":
        return uniform(n, chunks)
    if method == "parameters":
        return parameters(params, chunks)
    if method.startswith("type:"):
        return by_type(names, method[len("type:") :], chunks)
    if method == "torchtitan":
        return torchtitan(n, chunks)
    if method == "greedy":
        return greedy(times, chunks)
    raise PartitionError(
        f"unknown partition method {method!r}; use autopipe, {', '.join(BASELINES)} or type:REGEX."
    )
