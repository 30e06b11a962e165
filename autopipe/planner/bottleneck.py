"""The exact bottleneck partition solver: plain numbers in, boundaries out. No torch.

(The partition pass minimises the simulated step instead: autopipe/planner/step_solver.py. This solver, which
minimises the slowest chunk, serves the parameter-count and ``type:`` baselines.)

Problem. Cut layers ``0..L-1`` into ``K`` contiguous, non-empty stages ``[b_0, b_1), ...,
[b_{K-1}, b_K)`` with ``b_0 = 0`` and ``b_K = L``. Stage ``[a, b)`` costs

    cost(a, b) = sum(compute[a:b]) + cut[a-1] * (a > 0) + cut[b-1] * (b < L)

(compute, plus the send/recv time charged for the cut on each side of it), and stage ``s`` needs

    mem_s(a, b) = sum(static[a:b]) - tied repeats + inflight[s] * sum(activation[a:b])

bytes, which must not exceed ``limit``. Minimise the slowest stage, ``max_s cost(b_s, b_{s+1})``;
among the optimal cuts take one of the lowest peak memory ``max_s mem_s``.

Method. Write ``cost(a, b) = h[b] - g[a]`` with ``g[a] = P[a] - cut_in(a)``, ``h[b] = P[b] + cut_out(b)``
and ``P`` the prefix sums of ``compute``. The cut terms make ``cost`` non-monotone in the interval, so
no greedy "fill each stage up to T" argument holds; the feasibility test is a reachability DP instead:

    R_0 = {0}
    R_{s+1} = { b : exists a in R_s, m_s(b) <= a < b, h[b] - g[a] <= T }
    feasible(T) <=> L in R_K

where ``m_s(b)`` is the first ``a`` whose stage ``[a, b)`` fits in memory (memory only shrinks as a
stage loses layers, so the fitting ``a`` form a suffix). Testing ``h[b] - max g[a]`` over the window
``[m_s(b), b)`` settles every ``b`` at once: a prefix maximum without a limit, a sparse-table range
maximum with one. One test costs O(K·L) (O(K·L·log L) with a memory limit), vectorised with numpy.

``feasible`` is monotone in T and the optimum is one of the values ``h[b] - g[a]``, so the search runs
over those candidates, never over floats: keep ``lo`` infeasible and ``hi`` the bottleneck of a cut
actually found; count the candidates strictly between (per b, a range of the sorted ``g``); probe a
random one; stop when none is left, then ``hi`` is the optimum exactly. Expected O(log L) probes
(the candidates are at most L²). The peak-memory tie-break then bisects over integer byte limits
with T fixed at the optimum: O(log(bytes / gcd of the byte counts)) more probes.

Example:
    >>> solve([1, 1, 1, 1, 2, 2], 3).boundaries
    (0, 3, 5, 6)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["StageCosts", "Solution", "solve", "fits", "min_peak_memory", "NoBottleneckCut"]


class NoBottleneckCut(Exception):
    """No cut into the asked number of stages fits the memory limit (the partitioner explains why)."""


@dataclass(frozen=True)
class Solution:
    """An optimal cut: boundaries (K+1 indices from 0 to L), its bottleneck time and peak memory."""

    boundaries: tuple[int, ...]
    bottleneck: float
    peak_memory: int
    probes: int  # feasibility tests run, for the benchmark


class StageCosts:
    """Costs of any stage ``[a, b)`` from per-layer numbers, in O(1) (O(#tied groups) for memory).

    Args:
        compute: forward+backward seconds per layer.
        cut: seconds charged to each of the two stages beside a cut after layer i (L-1 values).
        static: parameter+gradient+optimizer bytes per layer (tied tensors included in each user).
        activation: bytes kept for backward per micro-batch, per layer.
        tied: (bytes of one copy, indices of the layers using it) per tied tensor; a stage holding
            n > 1 of those layers counts n - 1 copies too many, which are subtracted.
    """

    def __init__(
        self,
        compute: Sequence[float],
        cut: Sequence[float] | None = None,
        static: Sequence[int] | None = None,
        activation: Sequence[int] | None = None,
        tied: Sequence[tuple[int, Sequence[int]]] = (),
    ) -> None:
        n = len(compute)
        self.n = n
        comp = np.asarray(compute, dtype=np.float64)
        cuts = np.zeros(max(n - 1, 0)) if cut is None else np.asarray(cut, dtype=np.float64)
        if cuts.shape != (max(n - 1, 0),):
            raise ValueError(f"cut needs {max(n - 1, 0)} values (one per cut), got {cuts.shape[0]}")
        self.prefix = np.concatenate([[0.0], np.cumsum(comp)])
        self.cut_in = np.concatenate([[0.0], cuts, [0.0]])[: n + 1]  # cut before layer a
        self.cut_out = np.concatenate([[0.0], cuts, [0.0]])[: n + 1]  # cut after layer b-1
        self.cut_out[n] = 0.0  # the last stage sends nothing on
        self.cut_in[0] = 0.0  # the first stage receives from the data loader, not a peer
        self.g = self.prefix - self.cut_in
        self.h = self.prefix + self.cut_out
        z = np.zeros(n, dtype=np.int64)
        st = z if static is None else np.asarray(static, dtype=np.int64)
        ac = z if activation is None else np.asarray(activation, dtype=np.int64)
        self.static_prefix = np.concatenate([[0], np.cumsum(st)]).astype(np.int64)
        self.act_prefix = np.concatenate([[0], np.cumsum(ac)]).astype(np.int64)
        self.tied = [
            (int(w), np.concatenate([[0], np.cumsum(np.isin(np.arange(n), list(users)))]).astype(np.int64))
            for w, users in tied
            if len(users) > 1
        ]
        self.has_memory = bool(self.static_prefix[-1] or self.act_prefix[-1])
        self._q_cache: dict[int, np.ndarray] = {}

    def cost(self, a: int, b: int) -> float:
        """Seconds per micro-batch of stage [a, b): compute plus the cut terms on both sides."""
        return float(self.h[b] - self.g[a])

    def memory(self, a: int | np.ndarray, b: int | np.ndarray, inflight: int) -> int | np.ndarray:
        """Bytes stage [a, b) holds with ``inflight`` micro-batches of activations (vectorises)."""
        m = (self.static_prefix[b] - self.static_prefix[a]) + inflight * (self.act_prefix[b] - self.act_prefix[a])
        for w, count in self.tied:
            m = m - w * np.maximum(count[b] - count[a] - 1, 0)
        return m if isinstance(m, np.ndarray) else int(m)

    def binds(self, inflight: int, limit: int | None) -> bool:
        """Whether the limit can bind at all (the whole model in one stage would exceed it)."""
        return limit is not None and int(self.memory(0, self.n, inflight)) > limit

    def _q(self, inflight: int) -> np.ndarray:
        """Prefix sums of static + inflight x activation bytes (no tied tensors), cached per count."""
        cache = self._q_cache
        if inflight not in cache:
            if len(cache) > 64:
                cache.clear()
            cache[inflight] = self.static_prefix + inflight * self.act_prefix
        return cache[inflight]

    def window_start(self, inflight: int, limit: int, b: np.ndarray) -> np.ndarray:
        """m(b): the first a with memory(a, b) <= limit, for each b given (b itself when none fits)."""
        if not self.tied:  # a plain prefix difference: one binary search per b, in numpy
            q = self._q(inflight)
            return np.minimum(np.searchsorted(q, q[b] - limit, side="left"), b)
        lo, hi = np.zeros_like(b), b.copy()
        while np.any(lo < hi):  # vectorised bisection; memory(a, b) only shrinks as a grows
            mid = (lo + hi) // 2
            ok = (self.memory(mid, b, inflight) <= limit) | (lo == hi)  # settled entries stay put
            hi = np.where(ok, mid, hi)
            lo = np.where(ok, lo, mid + 1)
        return lo

    def window_end(self, inflight: int, limit: int, a: int) -> int:
        """The last b >= a with memory(a, b) <= limit: how far a stage starting at a can reach."""
        if not self.tied:
            q = self._q(inflight)
            return int(np.searchsorted(q, q[a] + limit, side="right")) - 1
        lo, hi = a, self.n  # memory(a, b) only grows with b
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int(self.memory(a, mid, inflight)) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _window_max(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """max(values[starts[i] : i]) for every i (-inf for an empty window), by a sparse table."""
    n = values.shape[0]
    idx = np.arange(n)
    length = idx - starts
    has = length > 0
    longest = int(length.max(initial=0))
    out = np.full(n, -np.inf)
    if longest <= 0:
        return out
    levels = longest.bit_length()  # level j holds the max of values[i : i + 2**j]
    table = np.empty((levels, n))
    table[0] = values
    span = 1
    for j in range(1, levels):
        table[j] = table[j - 1]
        np.maximum(table[j - 1, : n - span], table[j - 1, span:], out=table[j, : n - span])
        span *= 2
    k = np.zeros(n, dtype=np.int64)
    k[has] = np.log2(length[has]).astype(np.int64)
    # Two overlapping power-of-two blocks cover the window [starts[i], i).
    flat = table.reshape(-1)
    left = flat[k * n + np.minimum(starts, n - 1)]
    right = flat[k * n + np.maximum(idx - (1 << k), 0)]
    out[has] = np.maximum(left, right)[has]
    return out


class _BottleneckSearch:
    """Feasibility tests and cut recovery for one (costs, K, in-flight counts) instance."""

    def __init__(self, costs: StageCosts, stages: int, inflight: Sequence[int]) -> None:
        self.c = costs
        self.k = stages
        self.inflight = [int(x) for x in inflight]
        self.probes = 0
        self._binds: dict[tuple[int, int | None], bool] = {}

    def binds(self, s: int, limit: int | None) -> bool:
        """Whether stage s's memory can bind under ``limit`` (cached per in-flight count)."""
        key = (self.inflight[s], limit)
        if key not in self._binds:
            if len(self._binds) > 4096:  # the tie-break tries many limits
                self._binds.clear()
            self._binds[key] = self.c.binds(self.inflight[s], limit)
        return self._binds[key]

    def reach(self, t: float, limit: int | None) -> list[np.ndarray] | None:
        """R_0..R_K for bottleneck t (the recurrence in the module docstring); None if L not in R_K.

        Each step only looks at the band of positions a stage can span from R_s: from its first
        member to where the compute alone (a lower bound of the cost) or the memory runs out.
        """
        self.probes += 1
        g, h, n, prefix = self.c.g, self.c.h, self.c.n, self.c.prefix
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        out = [reach]
        lo, hi = 0, 0  # first and last member of R_s
        for s in range(self.k):
            binds = self.binds(s, limit)
            end = n
            if np.isfinite(t):  # cost >= compute, so b cannot pass prefix[hi] + t (with a rounding margin)
                bound = prefix[hi] + t + 1e-9 * (abs(prefix[hi]) + abs(t) + 1.0)
                end = min(end, int(np.searchsorted(prefix, bound, side="right")) - 1)
            if binds:  # a stage from the last member of R_s must still fit
                end = min(end, self.c.window_end(self.inflight[s], limit, hi))  # type: ignore[arg-type]
            if end <= lo:
                return None
            vals = np.where(reach[lo:end], g[lo:end], -np.inf)  # candidate starts a in [lo, end)
            if not binds:
                best = np.maximum.accumulate(vals)  # best[i]: max over a in [lo, lo + i]
                best_b = best  # for b = lo + 1 + i: window [lo, b)
            else:
                m = self.c.window_start(self.inflight[s], limit, np.arange(lo + 1, end + 1))  # type: ignore[arg-type]
                starts = np.maximum(m - lo, 0)
                local = np.concatenate([vals, [-np.inf]])  # positions lo .. end
                best_b = _window_max(local, np.concatenate([[0], starts]))[1:]
            hb = h[lo + 1 : end + 1]
            ok = (hb - best_b <= t) & (best_b > -np.inf)  # -inf: no admissible start, even for t = inf
            reach = np.zeros(n + 1, dtype=bool)
            reach[lo + 1 : end + 1] = ok
            members = np.flatnonzero(ok)
            if members.size == 0:
                return None
            lo, hi = lo + 1 + int(members[0]), lo + 1 + int(members[-1])
            out.append(reach)
        return out if out[-1][n] else None

    def recover(self, t: float, limit: int | None, reach: list[np.ndarray]) -> tuple[int, ...]:
        """Walk back from L through R_K..R_0, taking the cheapest admissible stage each time."""
        g, h = self.c.g, self.c.h
        bounds = [self.c.n]
        b = self.c.n
        for s in range(self.k - 1, -1, -1):
            binds = self.binds(s, limit)
            lo = int(self.c.window_start(self.inflight[s], limit, np.array([b]))[0]) if binds else 0  # type: ignore[arg-type]
            cand = np.arange(lo, b)
            cand = cand[reach[s][lo:b] & (h[b] - g[lo:b] <= t)]
            a = int(cand[np.argmax(g[cand])])
            bounds.append(a)
            b = a
        return tuple(reversed(bounds))

    def measure(self, bounds: Sequence[int]) -> tuple[float, int]:
        costs = [self.c.cost(a, b) for a, b in zip(bounds, bounds[1:])]
        mems = [int(self.c.memory(a, b, self.inflight[s])) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        return max(costs), max(mems)


def _candidates_between(g_sorted: np.ndarray, h: np.ndarray, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Per b, the index range [first, last) in sorted g of the values h[b] - g strictly inside (lo, hi).

    Found by bisection on the very expression the feasibility test evaluates, so float rounding
    cannot make the two disagree (h - x is monotone in x under rounding too).
    """
    n = g_sorted.shape[0]

    def first_index(pred_on_diff) -> np.ndarray:  # first i with pred(h - g_sorted[i]) true
        lo_i = np.zeros(h.shape[0], dtype=np.int64)
        hi_i = np.full(h.shape[0], n, dtype=np.int64)
        while np.any(lo_i < hi_i):
            mid = (lo_i + hi_i) // 2
            ok = (pred_on_diff(h - g_sorted[np.minimum(mid, n - 1)]) & (mid < n)) | (lo_i == hi_i)
            hi_i = np.where(ok, mid, hi_i)
            lo_i = np.where(ok, lo_i, mid + 1)
        return lo_i

    # g ascending => h - g descending: those < hi come after those >= hi, and so on.
    first = first_index(lambda d: d < hi)
    last = first_index(lambda d: d <= lo)
    return first, np.maximum(last, first)


def solve(
    compute: Sequence[float] | StageCosts,
    stages: int,
    *,
    inflight: Sequence[int] | None = None,
    limit: int | None = None,
    seed: int = 0,
) -> Solution:
    """Optimal contiguous cut of ``compute`` (or a ready StageCosts) into ``stages`` non-empty stages.

    ``inflight[s]`` multiplies stage s's activation bytes (default 1); ``limit`` caps each stage's
    bytes. Raises :class:`NoBottleneckCut` when no cut fits and ValueError when stages is out of range.
    """
    costs = compute if isinstance(compute, StageCosts) else StageCosts(compute)
    n = costs.n
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
    search = _BottleneckSearch(costs, stages, inflight if inflight is not None else [1] * stages)
    reach = search.reach(np.inf, limit)
    if reach is None:
        raise NoBottleneckCut
    bounds = search.recover(np.inf, limit, reach)
    hi, _ = search.measure(bounds)
    # Anything below this is infeasible: the compute alone must fit into `stages` stages.
    lower = max(costs.prefix[-1] / stages, float(np.max(np.diff(costs.prefix), initial=0.0)))
    lo = np.nextafter(lower * (1 - 1e-12), -np.inf)
    g_order = np.sort(costs.g)
    rng = np.random.default_rng(seed)
    while True:
        first, last = _candidates_between(g_order, costs.h, lo, hi)
        counts = last - first
        total = int(counts.sum())
        if total == 0:
            break  # hi is a candidate, reached by a real cut, and every smaller candidate failed
        pick = int(rng.integers(total))
        row = int(np.searchsorted(np.cumsum(counts), pick, side="right"))
        offset = pick - int(np.cumsum(counts)[row - 1] if row else 0)
        t = float(costs.h[row] - g_order[first[row] + offset])
        r = search.reach(t, limit)
        if r is None:
            lo = t
        else:
            bounds = search.recover(t, limit, r)
            hi, _ = search.measure(bounds)
    best_time = hi
    bounds, peak = _lowest_peak(search, best_time, bounds, limit)
    return Solution(tuple(bounds), best_time, peak, search.probes)


def _lowest_peak(search: _BottleneckSearch, t: float, bounds: tuple[int, ...], limit: int | None) -> tuple[tuple[int, ...], int]:
    """Among cuts with bottleneck <= t, one of the lowest peak memory: bisection over integer bytes."""
    _, peak = search.measure(bounds)
    c = search.c
    if not c.has_memory:
        return bounds, peak
    # Every memory figure is a sum of multiples of the per-layer and tied byte counts, so only
    # multiples of their gcd need trying (4 for float32 tensors, often far more).
    unit = int(np.gcd.reduce(np.concatenate([np.diff(c.static_prefix), np.diff(c.act_prefix), [w for w, _ in c.tied]]).astype(np.int64)))
    unit = max(unit, 1)
    # Every layer sits in some stage, which holds at least that layer alone.
    one = c.memory(np.arange(c.n), np.arange(1, c.n + 1), min(search.inflight))
    lo = (int(np.max(one)) - 1) // unit  # in units; infeasible
    while peak // unit - lo > 1:
        mid = (lo + peak // unit) // 2 * unit
        r = search.reach(t, mid)
        if r is None:
            lo = mid // unit
        else:
            bounds = search.recover(t, mid, r)
            _, peak = search.measure(bounds)
    return bounds, peak


def fits(costs: StageCosts, stages: int, *, inflight: Sequence[int], limit: int | None) -> bool:
    """Whether some cut into ``stages`` non-empty stages keeps every stage within ``limit`` bytes."""
    if not 1 <= stages <= costs.n:
        return False
    return _BottleneckSearch(costs, stages, inflight).reach(np.inf, limit) is not None


def min_peak_memory(costs: StageCosts, stages: int, *, inflight: Sequence[int]) -> int:
    """The smallest per-stage memory limit any cut into ``stages`` stages meets, whatever its time."""
    search = _BottleneckSearch(costs, stages, inflight)
    reach = search.reach(np.inf, None)
    if reach is None:
        raise ValueError(f"cannot cut {costs.n} layers into {stages} non-empty stages")
    return _lowest_peak(search, np.inf, search.recover(np.inf, None, reach), None)[1]
