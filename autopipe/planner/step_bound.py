"""The lower bound of the step-time partitioner: paths of the op graph, and reachability over cut positions.

No torch. autopipe/planner/step_solver.py searches cuts; this module proves how good any cut can be.

Why the bound holds. A cut's simulated step is the longest path of its op graph (fixed orders: gpipe,
1f1b), so every path of that graph weighs at most the step. With one chunk per rank, take for each
stage s the paths that dwell on rank s:

- enter at rank s's first op along micro-batch 0's forwards through the stages before it, or at its
  first B along the round trip of that B's micro-batch (every forward, the backwards of stages > s);
- run rank s's own order from there to its last op (then the backwards of the stages before it), or
  to its last F (then that micro-batch's round trip: forwards of stages > s, every backward).

Each weighs ``pF·ΣF_{<s} + pB·ΣB_{<s} + cF·F_s + cB·B_s + qF·ΣF_{>s} + qB·ΣB_{>s}`` with the counts
read off the order (1f1b's "in and out by round trips" is ``Σ_{<s} t + (M - w_s)·t_s + 2·Σ_{>s} t``,
w_s the stage's warm-up forwards); rank s's order alone weighs ``M·t_s``. GPipe also has the path
through all forwards of stage s and then all backwards of another stage s', ``Σt + (M-1)(F_s + B_s')``,
which with ``max_s' B_s' >= max(ΣB/S, the largest layer's b)`` bounds every cut (and its mirror).
Drop the other stages' send/recv and recompute seconds (>= 0, positive weights) and each bound of
stage s depends on its own chunk [a, b) alone, as ``H(b) - G(a)``. Replacing G by its running maximum
only lowers the bound and makes "bound <= V" read ``a >= lo_s(b; V)``, as does "fits in memory under
some mode" (memory only grows with the chunk). So "some cut keeps every bound <= V" is a
reachability over cut positions,

    R_0 = {0},   R_{s+1} = { b : some a in R_s with lo_s(b; V) <= a < b },   feasible(V) <=> L in R_K,

O(K·L) with prefix counts, and a V it refutes is below every cut's step. The test only visits
positions that can still reach L (walking back from L, each stage starting as early as a monotone
weakening of its bounds allows) and that a stage can reach (compute alone <= V / M), a few per stage
near the bound. Averaging one round-trip path per stage with weights that count every stage alike
gives ``step >= (M + S - 1)/S·(ΣF + ΣB)`` for 1f1b (the weights solve a K x K system and are used only
when non-negative, as they are for every M > S tried, S up to 39); the bisection starts there.

The same recurrence with saturating counts counts the cuts whose bounds are all <= V, and walks
back from L recover cuts.

Example (1f1b, 2 stages, 4 micro-batches: stage 0 warms up one forward, so in and out by round trips
it runs M - 1 = 3 of its F and B; stage 1's F and B twice more):
    >>> [(f.cf, f.cb, f.qf, f.qb) for f in dwell_forms("1f1b", 2, 4, 0.0, 0.0)[0] if f.round_trip]
    [(3, 3, 2, 2)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .chunk_costs import ChunkCosts, position
from .schedules import fixed_orders

__all__ = ["Form", "NoCutFits", "as_states", "dwell_forms", "fits", "least_memory", "reach", "states_window", "walk",
           "count_cuts", "enumerate_cuts"]


class NoCutFits(Exception):
    """No cut into the asked number of chunks fits the memory limit under any allowed mode."""


def fits(costs: ChunkCosts, chunks: int, *, inflight: Sequence[int] = (), limit: int | None, modes: Sequence[int] = (0,),
         waiting: Sequence[int] | None = None, states: Sequence[Sequence[tuple[int, int]]] | None = None) -> bool:
    """Whether some cut into ``chunks`` non-empty chunks fits ``limit`` with some allowed mode each.
    Per chunk, ``states`` are the (units, waiting) that can be its peak (``schedules.peak_states``),
    each held under the limit; without them, ``inflight`` units of which ``waiting`` are past their
    input pass (see ChunkCosts.memory)."""
    if not 1 <= chunks <= costs.n:
        return False
    st = as_states(chunks, inflight, waiting, states)
    return reach(costs.n, chunks, lambda s, b, first: _memory_start(costs, st[s], limit, modes, b,
                                                                    position(s, chunks))) is not None


def least_memory(costs: ChunkCosts, chunks: int, *, inflight: Sequence[int] = (), modes: Sequence[int] = (0,),
                 waiting: Sequence[int] | None = None, states: Sequence[Sequence[tuple[int, int]]] | None = None) -> int:
    """The smallest per-chunk limit some cut into ``chunks`` chunks meets (bisection over bytes)."""
    idx = np.arange(costs.n)
    st = as_states(chunks, inflight, waiting, states)
    every = {x for chunk in st for x in chunk}
    # some chunk holds the layer that needs the most alone, in some state: below that nothing fits
    alone = np.min([costs.memory(idx, idx + 1, u, m, w) for m in modes for u, w in every], axis=0)
    lo = int(alone.max()) - 1
    # the whole model in its heaviest state fits any chunk
    hi = int(min(max(costs.memory(0, costs.n, u, m, w) for u, w in every) for m in modes))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(costs, chunks, limit=mid, modes=modes, states=st):
            hi = mid
        else:
            lo = mid
    return hi


def as_states(chunks: int, inflight: Sequence[int], waiting: Sequence[int] | None,
              states: Sequence[Sequence[tuple[int, int]]] | None) -> list[tuple[tuple[int, int], ...]]:
    """Per chunk, the (units, waiting) states it is held under: ``states`` as given, else one state
    each of ``inflight`` units, ``waiting`` of them past their input pass (default none)."""
    if states is not None:
        return [tuple(x) for x in states]
    wait = list(waiting) if waiting is not None else [0] * chunks
    return [((u, w),) for u, w in zip(inflight, wait)]


def _memory_start(costs: ChunkCosts, states: Sequence[tuple[int, int]], limit: int | None, modes: Sequence[int],
                  b: np.ndarray, where: str = "middle") -> np.ndarray:  # fmt: skip
    """The first start that fits ``limit`` in every state, under the best mode."""
    if limit is None:
        return np.zeros_like(b)
    return np.min([states_window(costs, m, states, limit, where)[b] for m in modes], axis=0)


def states_window(costs: ChunkCosts, mode: int, states: Sequence[tuple[int, int]], limit: int,
                  where: str) -> np.ndarray:
    """For every end: the first start from which a chunk at ``where`` fits ``limit`` under ``mode``
    in every one of its states (ChunkCosts.window_start per state, the latest start), skipping the
    states that no chunk's ratio of waiting to held bytes can make its heaviest (``_binding``)."""
    if where not in ("last", "only"):
        states = _binding(states, costs.hold_range(mode))
    wins = [costs.window_start(mode, u, limit, where, w) for u, w in states]
    return wins[0] if len(wins) == 1 else np.maximum.reduce(wins)


def _binding(states: Sequence[tuple[int, int]], ratio: tuple[float, float]) -> list[tuple[int, int]]:
    """Of a chunk's (units, waiting) states, in order from most held to most waiting (the hull
    vertices of ``schedules.peak_states``), those that are its heaviest for some ratio of a waiting
    unit's bytes to a held one's within ``ratio``: state i is heaviest between the ratios where it
    overtakes state i - 1 and where state i + 1 overtakes it. (The last chunk also holds the
    model's output per held unit, so it keeps them all.)"""
    lo, hi = ratio
    held = [u - w for u, w in states]
    wait = [w for _, w in states]
    cross = [(held[i] - held[i + 1]) / max(wait[i + 1] - wait[i], 1e-12) for i in range(len(states) - 1)]
    keep = []
    for i, st in enumerate(states):
        left = cross[i - 1] if i > 0 else 0.0
        right = cross[i] if i < len(cross) else np.inf
        if left <= hi and right >= lo:
            keep.append(st)
    return keep or list(states)


def reach(n: int, k: int, lo_of, span=None, finish=None) -> list[np.ndarray] | None:
    """R_0..R_K (boolean over positions 0..L) for admissible starts ``a >= lo_of(s, b, first)``; None if L not in R_K.

    Speed-ups that keep the answer: ``span(last)`` bounds how far a stage reaches from the last member
    of R_s, ``finish(stages)`` the least position from which that many stages can still reach L.
    """
    reach = np.zeros(n + 1, dtype=bool)
    reach[0] = True
    out = [reach]
    for s in range(k):
        members = np.flatnonzero(reach)
        if members.size == 0:
            return None
        first = int(members[0])
        end = n - (k - s - 1)
        if span is not None:
            end = min(end, span(int(members[-1])))
        if end <= first:
            return None
        start = first + 1 if finish is None else max(first + 1, finish(k - s - 1))
        if end < start:
            return None
        b = np.arange(start, end + 1)
        lo = np.maximum(lo_of(s, b, first), first)
        count = np.concatenate([[0], np.cumsum(reach)])  # count[x]: members below x
        ok = (lo <= b - 1) & (count[b] - count[np.minimum(lo, b)] > 0)
        reach = np.zeros(n + 1, dtype=bool)
        reach[b[ok]] = True
        out.append(reach)
    return out if out[-1][n] else None


def walk(reach: list[np.ndarray], lo_of, n: int, late: bool, prefer=None) -> tuple[int, ...]:
    """A cut through R_K..R_0: from L back, the latest (or earliest) admissible start each time;
    among those admissible under ``prefer`` (another lo_of, e.g. without recompute) when there are any."""
    bounds = [n]
    b = n
    for s in range(len(reach) - 2, -1, -1):
        lo = int(lo_of(s, np.array([b]), 0)[0])
        cand = np.flatnonzero(reach[s][lo:b]) + lo
        if prefer is not None:
            better = cand[cand >= int(prefer(s, np.array([b]), 0)[0])]
            cand = better if better.size else cand
        b = int(cand[-1] if late else cand[0])
        bounds.append(b)
    return tuple(reversed(bounds))


def count_cuts(n: int, k: int, lo_arrays: list[np.ndarray], cap: int) -> int:
    """How many cuts have every stage admissible (``lo[s][b] <= a < b``), or ``cap`` if at least that many.

    Counts saturate at ``cap``, so every partial sum is an exact integer in float64 (the true counts
    can be astronomically large, and differences of such sums would lose them)."""
    ways = np.zeros(n + 1)
    ways[0] = 1.0
    b = np.arange(n + 1)
    for s in range(k):
        acc = np.concatenate([[0.0], np.cumsum(ways)])
        ways = np.minimum(np.where(lo_arrays[s] < b, acc[b] - acc[lo_arrays[s]], 0.0), cap)
    return int(ways[n])


def enumerate_cuts(n: int, k: int, lo_arrays: list[np.ndarray]) -> np.ndarray:
    """Every cut with every stage admissible, as rows of k + 1 boundaries."""
    b = np.arange(n + 1)
    alive = [np.zeros(n + 1, dtype=bool)]
    alive[0][0] = True
    for s in range(k):  # positions reachable after s + 1 stages
        acc = np.concatenate([[0], np.cumsum(alive[s])])
        alive.append((lo_arrays[s] < b) & (acc[b] - acc[lo_arrays[s]] > 0))
    rows: list[tuple[int, ...]] = []

    def back(s: int, end: int, tail: tuple[int, ...]) -> None:  # tail: the boundaries from `end` on
        if s == 0:
            rows.append(tail)
            return
        lo = int(lo_arrays[s - 1][end])
        for a in (np.flatnonzero(alive[s - 1][lo:end]) + lo).tolist():
            back(s - 1, a, (a,) + tail)

    if alive[k][n]:
        back(k, n, (n,))
    return np.array(rows, dtype=np.int64).reshape(-1, k + 1)



# ---- the dwell paths of one-chunk-per-rank orders ----


@dataclass(frozen=True)
class Form:
    """A path's weight for stage s: pF·PF[a] + pB·PB[a] + cF·F(a,b) + cB·B(a,b) + qF·(PF[L]-PF[b]) + qB·(PB[L]-PB[b]) + const."""

    pf: int
    pb: int
    cf: int
    cb: int
    qf: int
    qb: int
    const: float = 0.0
    round_trip: bool = False  # entered and left by round trips (the form the flat bound averages)

    def arrays(self, c: ChunkCosts, xm: np.ndarray, first: int, top: int) -> tuple[np.ndarray, np.ndarray]:
        """(G over starts first..top, H over ends first..top) with weight = H[b] - G[a] (indices from first).

        G is monotonised by a running maximum from ``first``: larger G only lowers the weight, so the
        result is still a lower bound, and "weight <= v" becomes "a >= the first G >= H[b] - v"."""
        n = c.n
        pf, pb, x = c.pf[first : top + 1], c.pb[first : top + 1], xm[first : top + 1]
        g = (self.cf - self.pf) * pf + (self.cb - self.pb) * pb + self.cb * x
        h = (self.cf - self.qf) * pf + (self.cb - self.qb) * pb + self.cb * x
        h = h + (self.qf * c.pf[n] + self.qb * c.pb[n] + self.const)
        if c.nonnegative and self.cf >= self.pf and self.cb >= self.pb:  # sums of prefix sums: non-decreasing
            return g, h
        return np.maximum.accumulate(g), h


def dwell_forms(schedule: str, ranks: int, m: int, f_min: float, b_min: float) -> list[list[Form]]:
    """Per stage, the dwell paths of the module docstring (one chunk per rank)."""
    orders = fixed_orders(schedule, ranks, 1, m)
    out = []
    for s, order in enumerate(orders):
        kinds = [kind for kind, _, _ in order]
        nf = np.concatenate([[0], np.cumsum([kd == "F" for kd in kinds])])  # F ops before position x
        nb = np.concatenate([[0], np.cumsum([kd == "B" for kd in kinds])])
        first_b = kinds.index("B")
        last_f = len(kinds) - 1 - kinds[::-1].index("F")
        # (position, pF, pB, cF, cB, qF, qB) added by each way in and out
        entries = [(0, 1, 0, 0, 0, 0, 0), (first_b, 1, 0, 1, 0, 1, 1)]
        exits = [(len(kinds) - 1, 0, 1, 0, 0, 0, 0), (last_f, 0, 1, 0, 1, 1, 1)]
        forms = {}
        for i, (pe, *e) in enumerate(entries):
            for j, (px, *x) in enumerate(exits):
                if px < pe:
                    continue
                f = [u + w for u, w in zip(e, x)]
                f[2] += int(nf[px + 1] - nf[pe])
                f[3] += int(nb[px + 1] - nb[pe])
                forms[tuple(f)] = forms.get(tuple(f), False) or (i == j == 1)
        out.append([Form(*f, const=0.0, round_trip=trip) for f, trip in sorted(forms.items())])
    if schedule == "gpipe":
        # All forwards of stage s, then all backwards of whichever stage has the most backward (and
        # the mirror): sum(t) + (M-1)(F_s + max B) with max B >= mean and >= any single layer's B.
        for s in range(ranks):
            out[s].append(Form(1, 1, m, 1, 1, 1, (m - 1) * b_min))
            out[s].append(Form(1, 1, 1, m, 1, 1, (m - 1) * f_min))
    return out
