"""What any chunk ``[a, b)`` of layers costs under each recompute mode, from per-layer numbers. No torch.

The step-time partitioner (step_solver.py) reads chunks through this: forward and backward seconds,
the send/recv seconds at the cuts on either side, and the bytes a chunk holds. All in O(1) per chunk
from prefix sums (O(#tied groups) for memory), vectorised over arrays of (a, b).

A recompute mode changes two things per layer: the activation bytes kept per micro-batch and the
seconds added to the backward. "none" is the layer's own figures. The memory follows autopipe.planner.memory
(one source for the plan's figures and the partitioner's):

    memory(a, b) = static(a, b) - tied repeats
                   + max(inflight * kept_m(a, b) + max(transient_m[a:b])
                         + waiting * (hold_m(a, b) - kept_m(a, b))   (zero-bubble: units past B, before W)
                         + inflight * held,   (the model's last output, held until its backward; b = L only)
                         step(a, b) - tied repeats)   (the optimizer step's temporaries, after the backward)
                   + M * cut(a - 1) + M * cut(b - 1)   (torch's receive buffers; a > 0, b < L only)

where transient_m is a layer's one-layer peak on top (under recompute: its plain activations,
rematerialised for one micro-batch). Without the receive buffers every term only grows when the
chunk gains a layer (a tied repeat removes at most the tensor the added layer brought), so the
layers that fit ``limit`` with a chunk ending at b form a suffix ``[window_start(b), b)``. The
buffer before a chunk depends on where it starts, which can break that order (a layer with a large
output); the windows therefore use the buffer term's running maximum from the right, which never
charges less than the real buffer: a chunk they admit fits, and where cut sizes do not fall as a
grows (a transformer's hidden states) they are exact.

Example:
    >>> c = ChunkCosts(forward=[1, 1, 1], backward=[2, 2, 2], activation=[10, 10, 10],
    ...                modes={"full": ([1, 1, 1], [2, 2, 2])})
    >>> c.modes, int(c.memory(0, 3, 2, 0)), int(c.memory(0, 3, 2, 1))
    (('none', 'full'), 60, 22)
"""

from __future__ import annotations

import hashlib
from typing import Mapping, Sequence

import numpy as np

__all__ = ["ChunkCosts", "position", "state_arrays"]

# Windows by (a digest of a costs object's bytes, the window's key), shared by every costs object
# with those bytes (ChunkCosts.window_start); cleared when it holds this many (a 70B search makes ~14k).
_SHARED_WINDOWS: dict[tuple[bytes, tuple], np.ndarray] = {}
_SHARED_MOST = 20_000


def state_arrays(states) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk, the (units, waiting) states that can be its peak, as two (P, 1, k) arrays for
    ``ChunkCosts.memory`` (a chunk with fewer than P states repeats its first)."""
    p = max(len(st) for st in states)
    units = np.array([[st[min(i, len(st) - 1)][0] for st in states] for i in range(p)], dtype=np.int64)
    waiting = np.array([[st[min(i, len(st) - 1)][1] for st in states] for i in range(p)], dtype=np.int64)
    return units[:, None, :], waiting[:, None, :]


def position(s: int, k: int) -> str:
    """Where chunk s of k sits, for ``ChunkCosts.window_start``: only, first, last or middle."""
    return "only" if k == 1 else "first" if s == 0 else "last" if s == k - 1 else "middle"


class ChunkCosts:
    """Per-chunk costs under recompute modes ("none" first, then the modes given).

    Args:
        forward, backward: seconds per layer and micro-batch (backward without recompute).
        one_way: seconds to send the tuple crossing the cut after layer i one way (L-1 values);
            a chunk pays the cut on each side once forward and once backward.
        static: parameter + gradient + optimizer bytes per layer (tied tensors in each user).
        activation: bytes kept for backward per micro-batch per layer without recompute.
        tied: (bytes of one copy, indices of its users[, its step temporaries]) per tied tensor;
            counted once per chunk.
        modes: name -> (extra backward seconds per layer, kept activation bytes per layer).
        transient: mode name -> one-layer peak per layer (default: 0 for none, a layer's plain
            activations under a recompute mode).
        held: bytes per micro-batch the last chunk holds until its backward (the model's output).
        hold: mode name -> bytes per layer a unit holds between its input and weight passes
            (zero-bubble schedules; default: what the mode keeps, as a unit before its backward).
        buffers: micro-batches M of torch's receive buffers at each cut facing another chunk
            (each holds the bytes crossing that cut, ``cut_bytes``).
        cut_bytes: bytes crossing the cut after layer i (L-1 values; default none).
        step: bytes per layer of the optimizer step's temporaries (foreach AdamW's), alive after
            the backward, when the activations are gone (default none).
        per_op: the engine's seconds per forward and per backward of every chunk, beyond its layers
            and cuts (autopipe.costs.engines); counted in ``comm`` (default none).
        first_backward: seconds per layer of the backward in the first chunk, where it differs from
            ``backward`` and is never more (torch's zbv runs the first stage's backward whole, the
            others split in two passes that take longer together); default ``backward``.
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
        *,
        transient: Mapping[str, Sequence[int]] | None = None,
        held: int = 0,
        hold: Mapping[str, Sequence[int]] | None = None,
        buffers: int = 0,
        cut_bytes: Sequence[int] | None = None,
        step: Sequence[int] | None = None,
        per_op: float = 0.0,
        first_backward: Sequence[float] | None = None,
    ) -> None:
        n = len(forward)
        self.n = n
        zero = np.zeros(n)
        ow = np.zeros(max(n - 1, 0)) if one_way is None else np.asarray(one_way, dtype=np.float64)
        if ow.shape != (max(n - 1, 0),):
            raise ValueError(f"one_way needs {max(n - 1, 0)} values (one per cut), got {ow.shape[0]}")
        fw, bw = np.asarray(forward, dtype=np.float64), np.asarray(backward, dtype=np.float64)
        first = bw if first_backward is None else np.asarray(first_backward, dtype=np.float64)
        if first.shape != bw.shape or np.any(first > bw):
            raise ValueError("first_backward needs one value per layer, none above backward's")
        self.pf = _prefix(fw)
        # pb / pt: the first chunk's figures, never above any other chunk's, so every bound the solver
        # builds on them stays a lower bound; pb_rest / pt_rest: a chunk starting after layer 0
        self.first_differs = first_backward is not None
        self.pb = _prefix(first)
        self.pt = _prefix(fw + first)  # its own prefix, so whole-number layer times give whole chunk times
        self.pb_rest = _prefix(bw) if self.first_differs else self.pb
        self.pt_rest = _prefix(fw + bw) if self.first_differs else self.pt
        self.comm_in = np.concatenate([[0.0], ow, [0.0]])[: n + 1]  # the cut before layer a (none for a = 0)
        self.comm_out = np.concatenate([[0.0], ow, [0.0]])[: n + 1]
        self.comm_out[n] = 0.0  # the last chunk sends nothing on
        self.comm_in[0] = 0.0  # the first reads the data loader
        # the engine's own seconds per F and per B of any chunk (autopipe.costs.engines), half on each
        # side: every chunk has one comm_in and one comm_out entry, so comm(a, b) gains per_op whatever
        # its cuts, and the solver's bounds over comm_in / comm_out hold as they are
        self.comm_in = self.comm_in + per_op / 2
        self.comm_out = self.comm_out + per_op / 2
        ints = np.zeros(n, dtype=np.int64)
        st = ints if static is None else np.asarray(static, dtype=np.int64)
        self.act = ints if activation is None else np.asarray(activation, dtype=np.int64)
        self.static_prefix = _prefix(st)
        self.step_prefix = _prefix(ints if step is None else np.asarray(step, dtype=np.int64))
        shared = [(w, users, rest[0] if rest else 0) for w, users, *rest in tied if len(users) > 1]
        self.tied = [(int(w), _prefix(np.isin(np.arange(n), list(users)).astype(np.int64))) for w, users, _ in shared]
        self.tied_step = [int(t) for _, _, t in shared]  # a tied tensor's step temporaries, once per chunk too
        self.tied_most = sum(w * (len(users) - 1) for w, users, _ in shared)
        names, extra, kept = ["none"], [_prefix(zero)], [_prefix(self.act)]
        for name, (x, k) in (modes or {}).items():
            if name == "none":
                continue
            names.append(name)
            extra.append(_prefix(np.asarray(x, dtype=np.float64)))
            kept.append(_prefix(np.asarray(k, dtype=np.int64)))
        self.modes = tuple(names)
        # a waiting unit's bytes beyond a held one's, per layer: a chunk's units are ``inflight``,
        # ``waiting`` of them past their B, so it holds (inflight - waiting) * kept + waiting * hold
        hold = hold or {}
        self.hold_extra = [
            _prefix(np.asarray(hold[name], dtype=np.int64) - np.diff(k)) if name in hold else _prefix(np.zeros(n, dtype=np.int64))
            for name, k in zip(names, kept)
        ]  # fmt: skip
        self.extra = extra  # prefix sums per mode
        self.kept = kept
        if transient is None:  # a layer's plain activations while it is recomputed; nothing otherwise
            transient = {name: (ints if name == "none" else self.act) for name in names}
        self._tables = [_SparseMax(np.asarray(transient.get(name, self.act), dtype=np.int64)) for name in names]
        self.held = int(held)
        cuts = np.zeros(max(n - 1, 0), dtype=np.int64) if cut_bytes is None else np.asarray(cut_bytes, dtype=np.int64)
        # receive buffers: before a chunk starting at a > 0, after one ending at b < L
        self.buf_in = np.concatenate([[0], int(buffers) * cuts, [0]])[: n + 1]
        self.buf_out = np.concatenate([[0], int(buffers) * cuts, [0]])[: n + 1]
        self.buf_out[n] = 0
        self.buf_in[0] = 0

        # Every per-layer second >= 0: prefix sums (and their non-negative combinations) never decrease.
        self.nonnegative = bool(fw.min(initial=0.0) >= 0 and first.min(initial=0.0) >= 0
                                and all(np.all(np.diff(x) >= 0) for x in extra))  # fmt: skip
        self._windows: dict[tuple[int, int, int], np.ndarray] = {}
        self._window_limit: int | None = None
        self._digest: bytes | None = None
        self._hold_ranges: dict[int, tuple[float, float]] = {}
        self.positions = np.arange(n + 1)  # this object's boundary j is layer positions[j] of the model

    # ---- cuts an engine allows ---------------------------------------------------------------------
    def restrict(self, cuts: Sequence[int]) -> "ChunkCosts":
        """The same costs over the groups of layers between allowed cuts: layer j of the result is
        layers ``[P[j], P[j+1])`` of this one, ``P = (0, *cuts, L)``.

        Every figure of a chunk whose ends are allowed cuts is the same in both (prefix sums are
        sliced at P, a group's one-layer peak is the largest of its layers', a tied tensor's users are
        still counted layer by layer), so a solver over the result is exact for the restricted
        problem; ``positions`` maps its boundaries back.

        Example:
            >>> c = ChunkCosts(forward=[1, 2, 3, 4], backward=[2, 4, 6, 8])
            >>> r = c.restrict([2])
            >>> r.n, r.positions.tolist(), float(r.time(0, 1)), float(c.time(0, 2))
            (2, [0, 2, 4], 9.0, 9.0)
        """
        p = np.array([0, *sorted({int(x) for x in cuts}), self.n], dtype=np.int64)
        if p.size > 2 and not (0 < p[1] and p[-2] < self.n):
            raise ValueError(f"cuts must lie strictly between 0 and {self.n}, got {list(cuts)}")
        out = object.__new__(ChunkCosts)
        out.__dict__.update(self.__dict__)
        out.n = int(p.size - 1)
        out.positions = self.positions[p]
        out.pf, out.pb, out.pt = self.pf[p], self.pb[p], self.pt[p]
        out.pb_rest, out.pt_rest = self.pb_rest[p], self.pt_rest[p]
        out.comm_in, out.comm_out = self.comm_in[p], self.comm_out[p]
        out.static_prefix, out.step_prefix = self.static_prefix[p], self.step_prefix[p]
        out.act = np.diff(_prefix(self.act)[p])
        out.tied = [(w, count[p]) for w, count in self.tied]
        out.extra = [x[p] for x in self.extra]
        out.kept = [k[p] for k in self.kept]
        out.hold_extra = [h[p] for h in self.hold_extra]
        # a group's one-layer peak: the largest of its layers' (max over a chunk is max over its groups)
        out._tables = [_SparseMax(np.asarray(t.query(p[:-1], p[1:]), dtype=t.table.dtype)) for t in self._tables]
        out.buf_in, out.buf_out = self.buf_in[p], self.buf_out[p]
        out._windows, out._window_limit, out._hold_ranges, out._digest = {}, None, {}, None
        return out

    # ---- time -----------------------------------------------------------------------------------
    def comm(self, a, b):
        """Seconds of send/recv one way (both cuts of the chunk)."""
        return self.comm_in[a] + self.comm_out[b]

    def forward(self, a, b):
        """Forward compute seconds of [a, b) (no communication)."""
        return self.pf[b] - self.pf[a]

    def backward(self, a, b, mode=0):
        """Backward compute seconds of [a, b) under mode index ``mode`` (recompute included)."""
        return self._span(self.pb, self.pb_rest, a, b) + self.extra_of(a, b, mode)

    def _span(self, first, rest, a, b):
        """rest[b] - rest[a], or first[b] for a chunk that starts at layer 0."""
        if not self.first_differs:
            return rest[b] - rest[a]
        return np.where(np.asarray(a) == 0, first[b], rest[b] - rest[a])

    def extra_of(self, a, b, mode):
        if np.isscalar(mode):
            x = self.extra[int(mode)]
            return x[b] - x[a]
        return np.choose(mode, [x[b] - x[a] for x in self.extra])

    def time(self, a, b, mode=0):
        """Seconds per micro-batch: forward + backward + the cuts' send/recv both ways."""
        return self._span(self.pt, self.pt_rest, a, b) + self.extra_of(a, b, mode) + 2 * self.comm(a, b)

    # ---- memory ---------------------------------------------------------------------------------
    def memory(self, a, b, inflight, mode=0, waiting=0):
        """Bytes chunk [a, b) holds with ``inflight`` micro-batches in flight, ``waiting`` of them
        past their input pass (zero-bubble), vectorises over a, b."""
        a, b = np.asarray(a), np.asarray(b)
        return self._core(a, b, inflight, mode, waiting) + self.buf_in[a] + self.buf_out[b]

    def _core(self, a, b, inflight, mode, waiting=0):
        """Memory without the receive buffers at the chunk's two ends."""
        a, b = np.asarray(a), np.asarray(b)
        m = self.static_prefix[b] - self.static_prefix[a]
        step = self.step_prefix[b] - self.step_prefix[a]
        for (w, count), t in zip(self.tied, self.tied_step):
            repeats = np.maximum(count[b] - count[a] - 1, 0)
            m, step = m - w * repeats, step - t * repeats
        act = inflight * self._kept(a, b, mode) + np.where(b == self.n, (inflight - waiting) * self.held, 0)
        if np.any(waiting):
            act = act + waiting * self._of(self.hold_extra, a, b, mode)
        if np.isscalar(mode):
            act = act + self._tables[int(mode)].query(a, b)
        else:
            act = act + np.choose(np.asarray(mode), [t.query(a, b) for t in self._tables])
        return m + np.maximum(act, step)

    def hold_range(self, mode: int) -> tuple[float, float]:
        """The least and the largest ratio of a waiting unit's bytes to a held one's that any chunk
        can have under ``mode``: a chunk's ratio (sums over its layers) lies between its layers'.
        Once per mode (every window asks it)."""
        if mode not in self._hold_ranges:
            self._hold_ranges[mode] = self._hold_range(mode)
        return self._hold_ranges[mode]

    def _hold_range(self, mode: int) -> tuple[float, float]:
        kept = np.diff(self.kept[mode])
        hold = kept + np.diff(self.hold_extra[mode])
        some = (kept > 0) | (hold > 0)
        if not some.any():
            return 1.0, 1.0
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(kept[some] > 0, hold[some] / np.maximum(kept[some], 1), np.inf)
        return float(ratio.min()), float(ratio.max())

    def _kept(self, a, b, mode):
        return self._of(self.kept, a, b, mode)

    @staticmethod
    def _of(prefixes, a, b, mode):
        if np.isscalar(mode):
            k = prefixes[int(mode)]
            return k[b] - k[a]
        return np.choose(mode, [k[b] - k[a] for k in prefixes])

    def window_start(self, mode: int, inflight: int, limit: int, position: str = "middle",
                     waiting: int = 0) -> np.ndarray:
        """For every b in 0..L: the first a with memory(a, b) <= limit (b itself when none fits). Cached.

        ``position`` says which chunk asks, because the ends' terms depend on it: the ``first`` chunk
        starts at 0 (no receive buffer before it: its window is 0 or empty); the ``last`` ends at L (no
        buffer after it, the output held); ``only`` is both; a ``middle`` chunk has both buffers.
        Chunks after the first start at 1 or later, and for them the start's buffer enters as its
        conservative envelope (see the module docstring); a middle chunk's end terms likewise, as a
        running maximum over ends, so its window never moves left as b grows.
        """
        key = (mode, inflight, limit, position, waiting)
        window = self._windows.get(key)
        if window is None:
            if limit != self._window_limit:  # a search holds one limit at a time: keep only its windows
                self._windows.clear()
                self._window_limit = limit
            # the cluster search builds many costs with the same bytes (they differ in seconds: links,
            # micro-batch counts): a window depends on the bytes alone, so they share it
            shared = (self._memory_digest(), key)
            window = _SHARED_WINDOWS.get(shared)
            if window is None:
                if len(_SHARED_WINDOWS) >= _SHARED_MOST:
                    _SHARED_WINDOWS.clear()
                window = _SHARED_WINDOWS[shared] = self._window_start(mode, inflight, limit, position, waiting)
                window.flags.writeable = False  # shared between objects: nobody may change it
            self._windows[key] = window
        return window

    def _memory_digest(self) -> bytes:
        """A digest of every figure ``memory`` and ``window_start`` read (bytes, never seconds): two
        costs with the same digest have the same windows."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(repr((self.n, self.held, self.tied_most, self.tied_step, [w for w, _ in self.tied])).encode())
            for a in (self.static_prefix, self.step_prefix, self.buf_in, self.buf_out, *self.kept, *self.hold_extra,
                      *(t.table for t in self._tables), *(count for _, count in self.tied)):
                h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
                h.update(str(a.dtype).encode())
            self._digest = h.digest()
        return self._digest

    def window_is_exact(self, mode: int, inflight: int, position: str = "middle", waiting: int = 0) -> bool:
        """Whether ``window_start`` admits every chunk that fits, not only some: its envelopes of the
        buffer terms are the terms themselves, i.e. ``q[a] - buf_in[a]`` never falls as a grows (a >= 1)
        and, for a middle chunk, ``q[b] + buf_out[b]`` never falls as b grows, q the prefix bytes under
        (mode, inflight, waiting) (a transformer's equal hidden states: always). The first chunk's is."""
        if position in ("first", "only"):
            return True
        q = self.static_prefix + inflight * self.kept[mode] + waiting * self.hold_extra[mode]
        if not bool(np.all(np.diff((q - self.buf_in)[1:]) >= 0)):
            return False
        return position != "middle" or bool(np.all(np.diff(q + self.buf_out) >= 0))

    def _window_start(self, mode: int, inflight: int, limit: int, position: str, waiting: int) -> np.ndarray:
        n = self.n
        b = np.arange(n + 1)
        held = np.where(b == n, (inflight - waiting) * self.held, 0)
        if position in ("first", "only"):
            fits = self.memory(np.zeros_like(b), b, inflight, mode, waiting) <= limit
            return np.where(fits & (b > 0), 0, b)
        q = self.static_prefix + inflight * self.kept[mode] + waiting * self.hold_extra[mode]
        # a-term: memory = q[b] - (q[a] - buf_in[a]) + ...; replacing q[a] - buf_in[a] by its running
        # minimum from the right over a >= 1 charges at least the real buffer and never rises in a
        g = (q - self.buf_in).astype(np.float64)
        g[0] = np.inf  # a chunk after the first never starts at 0
        g_env = np.minimum.accumulate(g[::-1])[::-1]
        in_env = np.where(b >= 1, q - g_env, 0).astype(np.int64)
        out = self.buf_out  # the held output is _core's (b = L)
        if position == "middle":  # end terms: their running maximum (with q) over ends, never falling
            out = (np.maximum.accumulate(q + out) - q).astype(np.int64)
        # Bracket with the plain prefix sums, then bisect inside: without the tied savings and with the
        # largest transient and end terms a chunk fits less (hi); with every saving and none, more (lo).
        top = int(self._tables[mode].table[0].max(initial=0)) + int(in_env[1:].max(initial=0))
        qs = q + self.step_prefix  # the optimizer step's temporaries, at most added to the rest
        hi = np.minimum(qs.searchsorted(qs[b] - (limit - top - out - held), side="left"), b)
        lo = np.minimum(q.searchsorted(q[b] - (limit + self.tied_most), side="left"), b)
        lo, hi = np.maximum(lo, 1), np.maximum(hi, 1)
        open_ = np.flatnonzero(lo < hi)
        while open_.size:  # bisect where the bracket is open; the window memory only shrinks as a grows
            mid = (lo[open_] + hi[open_]) // 2
            bb = b[open_]
            ok = self._core(mid, bb, inflight, mode, waiting) + in_env[mid] + out[bb] <= limit
            hi[open_] = np.where(ok, mid, hi[open_])
            lo[open_] = np.where(ok, lo[open_], mid + 1)
            open_ = open_[lo[open_] < hi[open_]]
        # hi's bracket assumed the window fits from hi on; check it, else nothing fits
        fits = (self._core(np.minimum(lo, b), b, inflight, mode, waiting) + in_env[np.minimum(lo, b)] + out
                <= limit) & (lo < b)
        return np.where(fits, lo, b)

    def fastest_modes(self, a, b, inflight, limit: int | None, allowed: Sequence[int], waiting=0) -> np.ndarray:
        """Per chunk, the allowed mode with the least backward that fits ``limit``; -1 where none fits.

        Recompute only adds time, so for a fixed cut this choice is optimal chunk by chunk. Ties go
        to the earlier mode (none before selective before full). ``inflight`` and ``waiting`` may
        carry a leading axis of states (``state_arrays``): a mode fits when it fits in all of them.
        """
        a, b = np.asarray(a), np.asarray(b)
        best = np.full(np.broadcast(a, b).shape, -1, dtype=np.int64)
        best_time = np.full(best.shape, np.inf)
        for m in allowed:
            extra = self.extra_of(a, b, m)
            ok = np.ones(best.shape, dtype=bool) if limit is None else self.memory(a, b, inflight, m, waiting) <= limit
            while ok.ndim > best.ndim:
                ok = ok.all(axis=0)
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
        # floor(log2(length)) and 2**that for every length 0..n (0 and 1 both level 0): looked up, not
        # computed, as the solver asks this tens of thousands of times a search
        lengths = np.maximum(np.arange(n + 2), 1)
        self._level = (np.frexp(lengths)[1] - 1).astype(np.int64)
        self._width = np.left_shift(1, self._level)

    def query(self, a, b):
        a, b = np.asarray(a), np.asarray(b)
        length = np.maximum(b - a, 0)
        k = self._level[length]
        n = self.table.shape[1]
        left = self.table[k, np.minimum(a, n - 1)]
        right = self.table[k, np.minimum(np.maximum(b - self._width[length], 0), n - 1)]
        return np.where(b > a, np.maximum(left, right), 0)
