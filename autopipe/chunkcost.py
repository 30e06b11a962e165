"""What any chunk ``[a, b)`` of layers costs under each recompute mode, from per-layer numbers. No torch.

The step-time partitioner (stepsolve.py) reads chunks through this: forward and backward seconds,
the send/recv seconds at the cuts on either side, and the bytes a chunk holds. All in O(1) per chunk
from prefix sums (O(#tied groups) for memory), vectorised over arrays of (a, b).

A recompute mode changes two things per layer: the activation bytes kept per micro-batch and the
seconds added to the backward. "none" is the layer's own figures. Under any other mode the chunk
also holds, for a moment in its backward, the plain activations of the one layer being recomputed:

    memory(a, b) = static(a, b) - tied repeats + inflight * kept_m(a, b) + [m != none] * max(act[a:b])

Every term only grows when the chunk gains a layer (a tied repeat removes at most the tensor the
added layer brought), so memory is monotone under interval inclusion, and so is every mode's time:
the layers that fit ``limit`` with a chunk ending at b form a suffix ``[window_start(b), b)``.

Example:
    >>> c = ChunkCosts(forward=[1, 1, 1], backward=[2, 2, 2], activation=[10, 10, 10],
    ...                modes={"full": ([1, 1, 1], [2, 2, 2])})
    >>> c.modes, int(c.memory(0, 3, 2, 0)), int(c.memory(0, 3, 2, 1))
    (('none', 'full'), 60, 22)
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["ChunkCosts"]


class ChunkCosts:
    """Per-chunk costs under recompute modes ("none" first, then the modes given).

    Args:
        forward, backward: seconds per layer and micro-batch (backward without recompute).
        one_way: seconds to send the tuple crossing the cut after layer i one way (L-1 values);
            a chunk pays the cut on each side once forward and once backward.
        static: parameter + gradient + optimizer bytes per layer (tied tensors in each user).
        activation: bytes kept for backward per micro-batch per layer without recompute.
        tied: (bytes of one copy, indices of its users) per tied tensor; counted once per chunk.
        modes: name -> (extra backward seconds per layer, kept activation bytes per layer).
    """

    def __init__(
        self,
        forward: Sequence[float],
        backward: Sequence[float],
        one_way: Sequence[float] | None = None,
        static: Sequence[int] | None = None,
        activation: Sequence[int] | None = None,
        tied: Sequence[tuple[int, Sequence[int]]] = (),
        modes: Mapping[str, tuple[Sequence[float], Sequence[int]]] | None = None,
    ) -> None:
        n = len(forward)
        self.n = n
        zero = np.zeros(n)
        ow = np.zeros(max(n - 1, 0)) if one_way is None else np.asarray(one_way, dtype=np.float64)
        if ow.shape != (max(n - 1, 0),):
            raise ValueError(f"one_way needs {max(n - 1, 0)} values (one per cut), got {ow.shape[0]}")
        fw, bw = np.asarray(forward, dtype=np.float64), np.asarray(backward, dtype=np.float64)
        self.pf = _prefix(fw)
        self.pb = _prefix(bw)
        self.pt = _prefix(fw + bw)  # its own prefix, so whole-number layer times give whole chunk times
        self.comm_in = np.concatenate([[0.0], ow, [0.0]])[: n + 1]  # the cut before layer a (none for a = 0)
        self.comm_out = np.concatenate([[0.0], ow, [0.0]])[: n + 1]
        self.comm_out[n] = 0.0  # the last chunk sends nothing on
        self.comm_in[0] = 0.0  # the first reads the data loader
        ints = np.zeros(n, dtype=np.int64)
        st = ints if static is None else np.asarray(static, dtype=np.int64)
        self.act = ints if activation is None else np.asarray(activation, dtype=np.int64)
        self.static_prefix = _prefix(st)
        self.tied = [
            (int(w), _prefix(np.isin(np.arange(n), list(users)).astype(np.int64))) for w, users in tied if len(users) > 1
        ]
        self.tied_most = sum(w * (len(users) - 1) for w, users in tied if len(users) > 1)
        names, extra, kept = ["none"], [_prefix(zero)], [_prefix(self.act)]
        for name, (x, k) in (modes or {}).items():
            if name == "none":
                continue
            names.append(name)
            extra.append(_prefix(np.asarray(x, dtype=np.float64)))
            kept.append(_prefix(np.asarray(k, dtype=np.int64)))
        self.modes = tuple(names)
        self.extra = extra  # prefix sums per mode
        self.kept = kept
        # Every per-layer second >= 0: prefix sums (and their non-negative combinations) never decrease.
        self.nonnegative = bool(fw.min(initial=0.0) >= 0 and bw.min(initial=0.0) >= 0 and all(np.all(np.diff(x) >= 0) for x in extra))
        self._table = _SparseMax(self.act)
        self._windows: dict[tuple[int, int, int], np.ndarray] = {}
        self._window_limit: int | None = None

    # ---- time -----------------------------------------------------------------------------------
    def comm(self, a, b):
        """Seconds of send/recv one way (both cuts of the chunk)."""
        return self.comm_in[a] + self.comm_out[b]

    def forward(self, a, b):
        """Forward compute seconds of [a, b) (no communication)."""
        return self.pf[b] - self.pf[a]

    def backward(self, a, b, mode=0):
        """Backward compute seconds of [a, b) under mode index ``mode`` (recompute included)."""
        return self.pb[b] - self.pb[a] + self.extra_of(a, b, mode)

    def extra_of(self, a, b, mode):
        if np.isscalar(mode):
            x = self.extra[int(mode)]
            return x[b] - x[a]
        return np.choose(mode, [x[b] - x[a] for x in self.extra])

    def time(self, a, b, mode=0):
        """Seconds per micro-batch: forward + backward + the cuts' send/recv both ways."""
        return self.pt[b] - self.pt[a] + self.extra_of(a, b, mode) + 2 * self.comm(a, b)

    # ---- memory ---------------------------------------------------------------------------------
    def memory(self, a, b, inflight, mode=0):
        """Bytes chunk [a, b) holds with ``inflight`` micro-batches in flight (vectorises over a, b)."""
        a, b = np.asarray(a), np.asarray(b)
        m = (self.static_prefix[b] - self.static_prefix[a]) + inflight * self._kept(a, b, mode)
        for w, count in self.tied:
            m = m - w * np.maximum(count[b] - count[a] - 1, 0)
        transient = self._table.query(a, b)
        m = m + (transient if np.isscalar(mode) and mode else np.where(np.asarray(mode) > 0, transient, 0))
        return m

    def _kept(self, a, b, mode):
        if np.isscalar(mode):
            k = self.kept[int(mode)]
            return k[b] - k[a]
        return np.choose(mode, [k[b] - k[a] for k in self.kept])

    def window_start(self, mode: int, inflight: int, limit: int) -> np.ndarray:
        """For every b in 0..L: the first a with memory(a, b) <= limit (b itself when none fits). Cached."""
        key = (mode, inflight, limit)
        window = self._windows.get(key)
        if window is None:
            if limit != self._window_limit:  # a search holds one limit at a time: keep only its windows
                self._windows.clear()
                self._window_limit = limit
            window = self._windows[key] = self._window_start(mode, inflight, limit)
        return window

    def _window_start(self, mode: int, inflight: int, limit: int) -> np.ndarray:
        b = np.arange(self.n + 1)
        q = self.static_prefix + inflight * self.kept[mode]
        # Bracket with the plain prefix sums, then bisect inside: without the tied savings and with the
        # largest transient a chunk fits less (hi), with every saving and no transient more (lo).
        extra = int(self.act.max(initial=0)) if mode else 0
        hi = np.minimum(np.searchsorted(q, q[b] - (limit - extra), side="left"), b)
        lo = np.minimum(np.searchsorted(q, q[b] - (limit + self.tied_most), side="left"), b)
        if not self.tied and not mode:
            return hi
        open_ = np.flatnonzero(lo < hi)
        while open_.size:  # bisect only where the bracket is open; memory(a, b) only shrinks as a grows
            mid = (lo[open_] + hi[open_]) // 2
            ok = self.memory(mid, b[open_], inflight, mode) <= limit
            hi[open_] = np.where(ok, mid, hi[open_])
            lo[open_] = np.where(ok, lo[open_], mid + 1)
            open_ = open_[lo[open_] < hi[open_]]
        return lo

    def fastest_modes(self, a, b, inflight, limit: int | None, allowed: Sequence[int]) -> np.ndarray:
        """Per chunk, the allowed mode with the least backward that fits ``limit``; -1 where none fits.

        Recompute only adds time, so for a fixed cut this choice is optimal chunk by chunk. Ties go
        to the earlier mode (none before selective before full).
        """
        a, b = np.asarray(a), np.asarray(b)
        best = np.full(np.broadcast(a, b).shape, -1, dtype=np.int64)
        best_time = np.full(best.shape, np.inf)
        for m in allowed:
            extra = self.extra_of(a, b, m)
            ok = np.ones(best.shape, dtype=bool) if limit is None else self.memory(a, b, inflight, m) <= limit
            better = ok & (extra < best_time)
            best = np.where(better, m, best)
            best_time = np.where(better, extra, best_time)
        return best


def _prefix(x: np.ndarray) -> np.ndarray:
    return np.concatenate([np.zeros(1, dtype=x.dtype), np.cumsum(x)])


class _SparseMax:
    """max(values[a:b]) in O(1) per query (0 for an empty range), vectorised: a sparse table."""

    def __init__(self, values: np.ndarray) -> None:
        n = values.shape[0]
        self.n = n
        levels = max(n, 1).bit_length()
        table = np.zeros((levels, max(n, 1)), dtype=values.dtype)
        table[0, :n] = values
        span = 1
        for j in range(1, levels):  # level j: max of values[i : i + 2**j]
            table[j] = table[j - 1]
            np.maximum(table[j - 1, : n - span], table[j - 1, span:n], out=table[j, : n - span])
            span *= 2
        self.table = table

    def query(self, a, b):
        a, b = np.asarray(a), np.asarray(b)
        length = np.maximum(b - a, 1)
        k = np.log2(length).astype(np.int64) if length.ndim else int(np.log2(int(length)))
        n = self.table.shape[1]
        left = self.table[k, np.minimum(a, n - 1)]
        right = self.table[k, np.clip(b - (1 << k), 0, n - 1)]
        return np.where(b > a, np.maximum(left, right), 0)
