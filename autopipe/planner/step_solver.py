"""The step-time partitioner: cut the layers so the simulated step of the schedule is as short as possible.

Problem. Cut layers ``0..L-1`` into ``K = S·v`` non-empty chunks ``[b_c, b_{c+1})`` and give each chunk
a recompute mode, so that ``schedules.simulate`` of the chunks' forward/backward/send-recv seconds
takes the least time, with every chunk within ``limit`` bytes under its mode and its in-flight count.

Reduction to cuts. Every schedule runs a fixed op order (zbv: torch's ZB-V order), so the simulated
step is the longest path of the op graph, whose weights are the ops' durations, and it never shrinks
when an op grows. Recompute only adds backward time; so for a fixed cut the fastest mode that fits
each chunk is optimal, and the search is over cuts alone.

Lower bound. Every path of the op graph weighs at most the step of the cut it is taken in; the paths
that dwell on one rank give, per stage, a bound that depends on that stage's own chunk only, so "some
cut keeps every bound <= V" is a reachability over cut positions and a bisection on V proves that no
cut steps faster than ``LB`` (autopipe/planner/step_bound.py: the paths, the proof, the recurrence). With
virtual stages a rank runs M times its chunks' work, so ``step >= M·(ΣF + ΣB) / S`` and
``M·(f_i + b_i)`` for each layer i.

Method. (1) When all ``C(L-1, K-1)`` cuts cost at most ``enumerate_work`` op evaluations, simulate
them all (numpy, many cuts per call): exact. (2) Otherwise bisect on the bound and simulate the
candidates the reachability recovers at the first and the smallest passing V (walking back from L
with the latest or the earliest admissible start; with several modes also preferring no recompute,
and the bisection repeated without recompute, whose cuts the others contain), then, from the best
four, move one boundary, two, or a run of them while that shortens the step. (3) One chunk per rank: a cut whose step beats the best
found has all its bounds below that step, so when those cuts are few enough (counted by the same
recurrence), simulate them all: exact again. Otherwise the answer is the best found with ``LB``
beside it.

Allowed cuts. An engine that splits a model by module (torchtitan, Megatron-Core, DeepSpeed) can only
cut between whole modules: with ``cuts`` the search runs over the groups of layers between allowed
cuts (``ChunkCosts.restrict``: every chunk between allowed cuts costs the same there), so all of
the above holds for the restricted problem, its bound included.

Exactness: exact whenever (1) or (3) runs, which the property tests check against brute force over
every cut and mode; otherwise within the recorded gap of ``LB``. Complexity: (1) C(L-1, K-1) x ops;
(2) O(K·L·forms) per reachability test (the tests only visit positions that can still reach L, a few
per stage near the bound), O(log(width / tol)) tests, and a few vectorised simulations of O(ops)
each; (3) O(K·L) to count, plus the simulations.

Example:
    >>> from autopipe.planner.chunk_costs import ChunkCosts
    >>> costs = ChunkCosts(forward=[2/3, 5/3, 1/3, 2/3, 8/3, 1], backward=[4/3, 10/3, 2/3, 4/3, 16/3, 2])
    >>> sol = solve_step(costs, "interleaved1f1b", ranks=2, virtual=2, microbatches=4)
    >>> sol.boundaries, round(sol.step, 2), sol.exact
    ((0, 1, 4, 5, 6), 48.33, True)
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .chunk_costs import ChunkCosts, position, state_arrays
from .schedules import check_schedule, inflight_counts, step_times
from .step_bound import (
    Form,
    NoCutFits,
    as_states,
    count_cuts,
    dwell_forms,
    enumerate_cuts,
    reach,
    states_window,
    walk,
)

__all__ = ["StepSolution", "solve_step", "NoCutFits", "steps_above"]

# Simulating all cuts costs (cuts x ops) op evaluations; up to this many it is done outright.
ENUMERATE_WORK = 30_000_000
BISECTION_TOL = 1e-4  # relative width at which the bound's bisection stops
TIE = 1e-9  # relative difference under which two simulated steps are the same step


@dataclass(frozen=True)
class StepSolution:
    """The best cut found, its modes and simulated step, and a proven lower bound on every cut's step."""

    boundaries: tuple[int, ...]
    modes: tuple[int, ...]  # index into ChunkCosts.modes, per chunk
    step: float
    lower_bound: float  # no cut has a shorter step; equal to ``step`` when proven optimal
    exact: bool  # every cut that could beat it was simulated (so ``lower_bound == step``)
    simulated: int  # cuts simulated, for the benchmark
    probes: int  # reachability tests, for the benchmark


def solve_step(
    costs: ChunkCosts,
    schedule: str,
    *,
    ranks: int,
    virtual: int = 1,
    microbatches: int,
    inflight: Sequence[int] | None = None,
    waiting: Sequence[int] | None = None,
    limit: int | None = None,
    states: Sequence[Sequence[tuple[int, int]]] | None = None,
    modes: Sequence[int] = (0,),
    weight_share: float = 0.5,
    enumerate_work: int = ENUMERATE_WORK,
    cuts: Sequence[int] | None = None,
) -> StepSolution:
    """The cut of ``costs`` into ``ranks * virtual`` chunks with the shortest simulated step.

    ``inflight`` per chunk defaults to what the schedule holds, ``waiting`` of them past their input
    pass (zero-bubble; default none); ``states`` instead gives per chunk every (units, waiting) that can
    be its peak (``schedules.peak_states``), each held under the limit; ``limit`` caps each chunk's bytes;
    ``modes`` are the recompute modes (indices into ``costs.modes``) a chunk may use.
    ``enumerate_work`` bounds the brute force (0: bounds and candidates only).
    ``cuts``: the only layer indices (between 1 and L-1) a chunk may start at, e.g. an engine's module
    boundaries; the search then runs over the groups between them (``ChunkCosts.restrict``), exact as
    before for that smaller problem, and its lower bound holds for every allowed cut.
    Raises :class:`NoCutFits` when no cut fits and ValueError when there are too few layers (or cuts).
    """
    schedule = check_schedule(schedule, ranks, virtual, microbatches)
    k = ranks * virtual
    if not 1 <= k <= costs.n:
        raise ValueError(f"cannot cut {costs.n} layers into {k} non-empty chunks")
    if cuts is not None:
        costs = costs.restrict(cuts)
        if k > costs.n:
            raise ValueError(f"{costs.n - 1} allowed cuts leave at most {costs.n} non-empty chunks, not {k}")
    infl = list(inflight) if inflight is not None else inflight_counts(schedule, ranks, virtual, microbatches)
    sol = _StepSearch(costs, schedule, ranks, virtual, microbatches, as_states(k, infl, waiting, states), limit,
                      tuple(modes), weight_share).run(enumerate_work)
    if cuts is None:
        return sol
    return replace(sol, boundaries=tuple(int(costs.positions[b]) for b in sol.boundaries))


def steps_above(
    costs: ChunkCosts,
    schedule: str,
    step: float,
    *,
    ranks: int,
    microbatches: int,
    states: Sequence[Sequence[tuple[int, int]]],
    limit: int | None = None,
    modes: Sequence[int] = (0,),
    cuts: Sequence[int] | None = None,
    after: Sequence[float] | None = None,
) -> bool:
    """Whether every cut into ``ranks`` chunks (one per rank) that fits steps longer than ``step``:
    proven, never guessed, by the bound ``solve_step`` bisects on, at ``step``. With ``after``
    (seconds per layer that rank 0 spends on the layers it holds once its last op is done, e.g. its
    data-parallel traffic) the step is rank 0's end plus that.

    Why it is sound: a cut whose simulated step is at most ``step`` has every dwell path of every
    stage at most ``step`` (each path weighs at most the step, step_bound's module docstring) and
    fits the limit, so it is a walk through the reachability at ``step``; when L is not reachable
    there is no such cut (the windows admit every chunk that fits, ChunkCosts.window_is_exact; where
    they do not, nothing is refuted). The simple and flat bounds (``_simple_bound``, ``_flat_bound``) hold for
    every cut too. With ``after``: every one of those paths ends at an op of rank 0 (a dwell path
    leaves by the backwards of the stages before it, or by a round trip, both down to stage 0; a
    rank's own order, M·t_s, is followed by its last backward's way down to stage 0), so each weighs
    at most when rank 0's last op ends, and the step is at least that plus rank 0's ``after``: for
    each end b_1 of the first chunk, the reachability at ``step - Σ after[0:b_1]`` from that b_1
    alone; none reaching L refutes every cut. False means only "not refuted" (with virtual stages
    nothing is tried). The cluster search asks this before solving a layout that must beat the best
    it has solved (autopipe/cluster/layout_search.py), so most layouts cost a few reachabilities
    instead of a solve.

    Example:
        >>> c = ChunkCosts(forward=[1, 1, 1, 1], backward=[2, 2, 2, 2])
        >>> st = [((1, 0),), ((1, 0),)]
        >>> sol = solve_step(c, "1f1b", ranks=2, microbatches=2, states=st)
        >>> below = steps_above(c, "1f1b", sol.step * 0.999, ranks=2, microbatches=2, states=st)
        >>> at = steps_above(c, "1f1b", sol.step, ranks=2, microbatches=2, states=st)
        >>> below, at
        (True, False)
    """
    schedule = check_schedule(schedule, ranks, 1, microbatches)
    if cuts is not None:
        costs = costs.restrict(cuts)
    if not 1 <= ranks <= costs.n:
        return False  # the solve says what is wrong
    if limit is not None and not all(costs.window_is_exact(md, u, position(s, ranks), w)
                                     for s in range(ranks) for md in modes for u, w in states[s]):  # fmt: skip
        return False  # the windows refuse some chunk that fits (a cut size falling): they prove nothing here
    search = _StepSearch(costs, schedule, ranks, 1, microbatches, [tuple(x) for x in states], limit, tuple(modes), 0.5)
    if after is None:
        return search.lb > step or search.reach_at(step) is None
    # rank 0's tail for each end of its chunk (at the positions of the allowed cuts when restricted)
    tail = np.concatenate([[0.0], np.cumsum(np.asarray(after, dtype=np.float64))])[costs.positions]
    for b1 in range(1, costs.n - ranks + 2):
        v = step - float(tail[b1])
        if search.lb > v and bool(np.all(np.diff(tail[b1:]) >= 0)):
            return True  # no cut steps under v, and a later b_1 leaves no more
        if search.lb <= v and search.reach_at(v, first_end=b1) is not None:
            return False
    return True


# ---- the search ----------------------------------------------------------------------------------------

# Local search: boundary moves of these sizes, while the simulated work stays under LOCAL_WORK ops.
MOVES = (1, 2, 4, 8, 16, 64)
PAIR_MOVES = 16  # up to this many chunks the local search also moves two boundaries at once
LOCAL_STARTS = 4  # the best distinct candidates it starts from
LOCAL_WORK = 5_000_000
FORM_CACHE = 8_000_000  # floats of cached per-form arrays (positions x forms x modes); above, bands only
THRESHOLD_SIZE = 200_000  # positions x chunks up to which the cuts below the best step are counted
CANDIDATE_WORK = 3_000_000  # op evaluations spent on the bisection's candidate cuts
REACH_WORK = 80_000_000  # position x chunk x form steps spent on bisection tests


class _StepSearch:
    """One search: the costs, the schedule's shape, the limit and modes, the best cut seen, the counters."""

    def __init__(self, costs: ChunkCosts, schedule: str, ranks: int, virtual: int, m: int,
                 states: list[tuple[tuple[int, int], ...]], limit: int | None, modes: tuple[int, ...],
                 weight_share: float) -> None:  # fmt: skip
        self.c = costs
        self.schedule = schedule
        self.ranks, self.virtual, self.m = ranks, virtual, m
        self.k = ranks * virtual
        self.states = states  # per chunk: the (units, waiting) that can be its peak
        self.units, self.waits = state_arrays(states)
        self._wins: dict[tuple[int, int], np.ndarray] = {}  # (mode, chunk) -> its window, for this limit
        self._seen: dict[tuple[int, ...], tuple[float, np.ndarray]] = {}  # cut -> (its step, its modes)
        self.limit = limit
        self.modes = modes
        self.weight_share = weight_share
        self.ops = (3 if schedule == "zbv" else 2) * m * self.k
        self.simulated = 0
        self.probes = 0
        # (least step seen, peak memory, bottleneck, step, cut, modes) of the cut kept
        self.best: tuple[float, int, float, float, tuple[int, ...], tuple[int, ...]] | None = None
        # A rank runs M times the sum of its chunks; with v chunks per rank the chunk-time test aims
        # at M·v·t (balanced chunks) and proves nothing, with one it is the chain bound M·t.
        self.scale = m * virtual
        base = costs.pf + costs.pb
        x = [costs.extra[md] for md in modes]
        self.h = [base + xm + 2 * costs.comm_out for xm in x]  # t_m(a, b) >= h[b] - g[a]
        self.h_right = [np.minimum.accumulate(h[::-1])[::-1] for h in self.h]  # least h of any end >= b
        self.g = [np.maximum.accumulate(base + xm - 2 * costs.comm_in) for xm in x]
        n = costs.n
        self._f_min = max(costs.pf[n] / ranks, float(np.diff(costs.pf).max(initial=0.0)))  # max F_s >= both
        self._b_min = max(costs.pb[n] / ranks, float(np.diff(costs.pb).max(initial=0.0)))
        self.forms = dwell_forms(schedule, ranks, m, self._f_min, self._b_min) if virtual == 1 else [[] for _ in range(self.k)]
        self.lb = max(self._simple_bound(), self._flat_bound() if virtual == 1 else 0.0)
        # Per stage and mode, each form's (G, H, H's running minimum from the right) over all positions,
        # when that fits FORM_CACHE; else None and lo() computes the band it needs each time.
        self._arrays: list[list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]] | None = None
        if n * sum(len(f) for f in self.forms) * len(modes) <= FORM_CACHE:
            made: dict[tuple[Form, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
            self._arrays = []
            for forms in self.forms:
                per_mode = []
                for md in modes:
                    row = []
                    for form in forms:
                        if (form, md) not in made:
                            g, h = form.arrays(costs, costs.extra[md], 0, n)
                            made[(form, md)] = (g, h, np.minimum.accumulate(h[::-1])[::-1])
                        row.append(made[(form, md)])
                    per_mode.append(row)
                self._arrays.append(per_mode)
        # Python lists of the same sorted arrays for _lo_monotone's scalar look-ups: bisect on a list
        # returns what np.searchsorted(side="left") does on a sorted array, at a tenth of its call cost
        self._g_list = [g.tolist() for g in self.g]
        self._h_right_list = [h.tolist() for h in self.h_right]
        self._arrays_list = None if self._arrays is None else [
            [[(g.tolist(), right.tolist()) for g, _, right in row] for row in per_mode] for per_mode in self._arrays]

    # -- evaluation --
    def evaluate(self, cuts: np.ndarray) -> np.ndarray:
        """Simulated step of each row of boundaries (inf where a chunk fits no mode); keeps the best."""
        cuts = np.asarray(cuts, dtype=np.int64).reshape(-1, self.k + 1)
        steps = np.full(cuts.shape[0], np.inf)
        if cuts.shape[0] == 0:
            return steps
        c = self.c
        infl, wait = self.units, self.waits
        mode = np.empty((cuts.shape[0], self.k), dtype=np.int64)
        # a cut simulated before (the local search's rounds revisit their neighbours' neighbours) is
        # looked up: the same floats, as each row's simulation is its own (schedules.step_times)
        rows = [tuple(r) for r in cuts.tolist()]
        new = [i for i, r in enumerate(rows) if r not in self._seen]
        for i, r in enumerate(rows):
            if r in self._seen:
                steps[i], mode[i] = self._seen[r]
        if new:
            fresh = cuts[new]
            a, b = fresh[:, :-1], fresh[:, 1:]
            # each distinct (chunk, start, end) once: the local search's moves leave most chunks as they were
            span = c.n + 1
            key = (np.arange(self.k)[None, :] * span + a) * span + b
            uniq, inv = np.unique(key.ravel(), return_inverse=True)
            at = uniq // (span * span)
            fast = c.fastest_modes((uniq // span) % span, uniq % span, infl[:, 0, at], self.limit, self.modes,
                                   wait[:, 0, at])  # fmt: skip
            md_new = fast[inv.reshape(-1)].reshape(a.shape)
            st_new = np.full(len(new), np.inf)
            ok = np.all(md_new >= 0, axis=1)
            if ok.any():
                a, b, md = a[ok], b[ok], md_new[ok]
                st_new[ok] = step_times(self.schedule, forward=c.forward(a, b), backward=c.backward(a, b, md),
                                        comm=c.comm(a, b), ranks=self.ranks, microbatches=self.m,
                                        weight_share=self.weight_share)  # fmt: skip
                self.simulated += int(ok.sum())
            steps[new], mode[new] = st_new, md_new
            for j, i in enumerate(new):
                self._seen[rows[i]] = (float(st_new[j]), md_new[j])
        if np.isfinite(steps).any():
            self._offer(steps, cuts, mode, infl, wait)
        return steps

    def _offer(self, steps: np.ndarray, cuts: np.ndarray, mode: np.ndarray, infl: np.ndarray,
               wait: np.ndarray) -> None:
        """Keep the shortest step. Steps within TIE of it are equal (sums in another order differ in the
        last bits): among those the lowest peak chunk memory, then the lowest bottleneck, then the first."""
        low = float(steps.min())
        if self.best is not None:
            low = min(low, self.best[0])
        rows = np.flatnonzero(steps <= low * (1 + TIE))
        if rows.size == 0:
            return
        a, b, md = cuts[rows, :-1], cuts[rows, 1:], mode[rows]
        peak = np.max(self.c.memory(a, b, infl, md, wait).max(axis=0), axis=1)
        slow = np.max(self.c.time(a, b, md), axis=1)
        keys = sorted(zip(peak.tolist(), slow.tolist(), range(rows.size)))
        j = keys[0][2]
        cand = (low, keys[0][0], keys[0][1], float(steps[rows[j]]), tuple(int(x) for x in cuts[rows[j]]),
                tuple(int(x) for x in md[j]))  # fmt: skip
        if self.best is None or self.best[3] > low * (1 + TIE) or cand[1:3] < self.best[1:3]:
            self.best = cand
        else:
            self.best = (low, *self.best[1:])

    # -- bounds --
    def _simple_bound(self) -> float:
        """Every rank runs M times its chunks' work, and some chunk holds each layer."""
        c = self.c
        layer = np.diff(c.pf) + np.diff(c.pb)
        return max(self.m * float(c.pf[-1] + c.pb[-1]) / self.ranks, self.m * float(layer.max(initial=0.0)))

    def _flat_bound(self) -> float:
        """A weighted average of the stages' dwell bounds that weighs every stage alike: c·(ΣF + ΣB).

        Take per stage the form that counts F and B alike (1f1b's round trip in and out; none for
        gpipe, whose two-stage path gives sum(t) + (M-1)(max F + max B) directly). If weights
        lambda >= 0 make sum_s lambda_s·form_s = c·sum(t) for every cut, the step is >= c·(PF + PB).
        """
        c, n = self.c, self.c.n
        total = float(c.pf[n] + c.pb[n])
        if self.schedule == "gpipe":
            return total + (self.m - 1) * (self._f_min + self._b_min)
        rows = []
        for s, forms in enumerate(self.forms):
            trip = [f for f in forms if f.round_trip and f.pf == f.pb and f.cf == f.cb and f.qf == f.qb]
            if not trip:
                return 0.0
            f = trip[0]
            rows.append([f.pf] * s + [f.cf] + [f.qf] * (self.k - s - 1))
        try:
            mu = np.linalg.solve(np.array(rows, dtype=np.float64).T, np.ones(self.k))
        except np.linalg.LinAlgError:
            return 0.0
        if not np.all(mu >= 0) or mu.sum() <= 0:
            return 0.0
        # sum_s mu_s·form_s(cut) = sum(t) for every cut; with lambda = mu / sum(mu) the average is sum(t)/sum(mu)
        return total / float(mu.sum()) * (1 - 1e-12)  # a hair under: the solve rounds

    def _ceiling(self) -> float:
        """A v every cut that fits passes: M times all the seconds of every op, every cut sent both ways."""
        c = self.c
        most = c.pf[-1] + c.pb_rest[-1] + max(float(x[-1]) for x in c.extra) + 4 * float(c.comm_out.sum())
        return self.m * self.virtual * most * 2 + 1.0

    def _window(self, md: int, s: int) -> np.ndarray:
        """Chunk s's first start that fits the limit under mode md, for every end: in every state
        that can be its peak."""
        key = (md, s)
        win = self._wins.get(key)
        if win is None:
            win = self._wins[key] = states_window(self.c, md, self.states[s], self.limit, position(s, self.k))
        return win

    def lo(self, s: int, b: np.ndarray, v: float | None, first: int = 0, only: int | None = None) -> np.ndarray:
        """First admissible start of stage s for each end b (all >= first): memory, and every bound <= v,
        under some mode (some of the first ``only`` modes)."""
        c = self.c
        out = None
        top = int(b.max()) if b.size else first
        for i, md in enumerate(self.modes[:only]):
            lo = (np.zeros_like(b) if self.limit is None
                  else self._window(md, s)[b])  # fmt: skip
            if v is not None:
                lo = np.maximum(lo, self.g[i].searchsorted(self.h[i][b] - v / self.scale, side="left"))
                if self._arrays is not None:
                    for g, h, _ in self._arrays[s][i]:
                        lo = np.maximum(lo, g.searchsorted(h[b] - v, side="left"))
                else:  # only starts in [first, top] matter: the band's arrays, monotonised from first
                    for form in self.forms[s]:
                        g, h = form.arrays(c, c.extra[md], first, top)
                        lo = np.maximum(lo, first + g.searchsorted(h[b - first] - v, side="left"))
            out = lo if out is None else np.minimum(out, lo)
        return out

    def reach_at(self, v: float | None, only: int | None = None, first_end: int | None = None) -> list[np.ndarray] | None:
        """R_0..R_K at bound v (None: memory only) with the first ``only`` modes (None: all); with
        ``first_end``, the first chunk ends there and nowhere else."""
        self.probes += 1
        span = None
        if v is not None:  # the compute alone bounds how far a stage reaches: scale·(P[b] - P[a]) <= v
            p = self.c.pf + self.c.pb
            reach_t = v / self.scale * (1 + 1e-12)
            span = lambda last: int(np.searchsorted(p, p[last] + reach_t, side="right")) - 1  # noqa: E731
        lo_of = lambda s, b, first: self.lo(s, b, v, first, only)  # noqa: E731
        if first_end is not None:
            plain = lo_of
            lo_of = lambda s, b, first: (np.where(b == first_end, plain(s, b, first), b) if s == 0  # noqa: E731
                                         else plain(s, b, first))  # fmt: skip
        return reach(self.c.n, self.k, lo_of, span, self._finish(v, only))

    def _finish(self, v: float | None, only: int | None):
        """need[left]: the least position from which the last ``left`` stages can still reach L.

        Walking back from L, each stage starts as early as its bounds allow at the end it has. That
        is the farthest back any cut gets when the first admissible start never decreases as the end
        grows, which holds for memory; the bound terms get it by taking, per end b, the least
        threshold of any end >= b (a running minimum from the right, so weaker and monotone)."""
        need = [0] * (self.k + 1)
        if v is None and self.limit is None:
            return lambda left: 0
        pos = self.c.n
        for left in range(1, self.k + 1):
            pos = int(self._lo_monotone(self.k - left, pos, v, only))
            need[left] = pos
        return lambda left: need[left]

    def _lo_monotone(self, s: int, b: int, v: float | None, only: int | None) -> int:
        """lo(s, b, v) with every bound term replaced by its running minimum from the right."""
        out = b
        for i, md in enumerate(self.modes[:only]):
            lo = 0 if self.limit is None else int(self._window(md, s)[b])
            if v is not None and lo < out:  # (terms only raise lo: once at out, this mode cannot lower it)
                lo = max(lo, bisect.bisect_left(self._g_list[i], self._h_right_list[i][b] - v / self.scale))
                for g, right in self._arrays_list[s][i] if self._arrays_list is not None else ():
                    if lo >= out:
                        break
                    lo = max(lo, bisect.bisect_left(g, right[b] - v))
            out = min(out, lo)
        return out

    # -- driver --
    def run(self, enumerate_work: int) -> StepSolution:
        n, k = self.c.n, self.k
        if self.reach_at(None) is None:
            raise NoCutFits
        total = math.comb(n - 1, k - 1)
        if total * self.ops <= enumerate_work:
            for block in _all_cuts(n, k, max(1, 4_000_000 // self.ops)):
                self.evaluate(block)
            return self._solution(exact=True)
        found: list[tuple[int, ...]] = []
        hi = None
        if len(self.modes) > 1 and self.reach_at(None, only=1) is not None:
            # Recompute costs time: the cuts that need none are searched too (their bound is not one
            # for the whole problem, so it is not kept), and where they pass, all modes pass.
            _, hi, found = self._bisect(1)
        lo, _, more = self._bisect(None, hi)
        found = more + found
        # The tightest passes first, up to a budget of op evaluations.
        unit = self.ops
        order = np.array(list(dict.fromkeys(found))[: max(1, CANDIDATE_WORK // unit)])
        steps = self.evaluate(order)
        # With one chunk per rank every failed v is a lower bound on every cut's step.
        bound = max(self.lb, lo) if self.virtual == 1 else self.lb
        self._local_search([tuple(order[i]) for i in np.argsort(steps, kind="stable")[:LOCAL_STARTS] if np.isfinite(steps[i])])
        if self.virtual == 1 and self.best is not None and self._threshold(self.best[0], enumerate_work):
            return self._solution(exact=True)
        return self._solution(exact=False, bound=bound)

    def _bisect(self, only: int | None, passing: float | None = None) -> tuple[float, float, list[tuple[int, ...]]]:
        """Bisection on the bound: ``lo`` fails (or is the simple bound), ``hi`` passes (``passing`` is
        known to). Returns lo, hi and the cuts walked at the tightest and the first passing v."""
        n = self.c.n
        lo = self.lb
        v, grow = (lo, 0.001) if passing is None else (passing, 0.0)
        while (r := self.reach_at(v, only)) is None:  # grow until some cut passes (usually within a few percent)
            lo, v, grow = v, (v * (1 + grow) if v > 0 else self._ceiling()), grow * 4
        first = self._walks(r, v, only)
        hi, last = v, r
        # Each test costs about K·L·(forms + 1) steps; at scale a few tests pin the bound well enough.
        tests = self.probes + max(4, REACH_WORK // (self.k * n * (1 + max(len(f) for f in self.forms))))
        while hi - lo > BISECTION_TOL * hi and self.probes < tests:
            v = 0.5 * (lo + hi)
            r = self.reach_at(v, only)
            if r is None:
                lo = v
            else:
                hi, last = v, r
        return lo, hi, self._walks(last, hi, only) + first

    def _walks(self, r: list[np.ndarray], v: float, only: int | None) -> list[tuple[int, ...]]:
        lo_of = lambda s, b, first: self.lo(s, b, v, first, only)  # noqa: E731
        walks = [walk(r, lo_of, self.c.n, late=True), walk(r, lo_of, self.c.n, late=False)]
        if len(self.modes[:only]) > 1:  # recompute costs time: also the cuts that use the first mode where they can
            plain = lambda s, b, first: self.lo(s, b, v, first, only=1)  # noqa: E731
            walks += [walk(r, lo_of, self.c.n, late=True, prefer=plain), walk(r, lo_of, self.c.n, late=False, prefer=plain)]
        return walks

    def _local_search(self, starts: list[tuple[int, ...]]) -> None:
        """From each start, move one boundary (by 1 to 64 layers), two (by 1 to 3), or a run of them (by 1)
        to the neighbour with the shortest step while that shortens it; a round is one batch of simulations."""
        if self.k == 1:
            return
        pairs = list(itertools.combinations(range(1, self.k), 2)) if self.k <= PAIR_MOVES else []
        shifts = [(di, dj) for di in (-3, -2, -1, 1, 2, 3) for dj in (-3, -2, -1, 1, 2, 3)]
        per_round = (2 * (self.k - 1) * len(MOVES) + len(pairs) * (len(shifts) + 2)) * self.ops
        rounds = LOCAL_WORK // max(per_round, 1)
        for start in starts:
            cut = np.array(start)
            current = None
            while rounds > 0:
                rounds -= 1
                moves = []
                # plain lists: the cut is strictly increasing, so a move keeps it so when the moved
                # boundaries stay strictly between their neighbours (checked there alone)
                at = [int(x) for x in cut]
                for j in range(1, self.k):
                    for d in MOVES:
                        for x in (at[j] - d, at[j] + d):
                            if at[j - 1] < x < at[j + 1]:
                                moved = at.copy()
                                moved[j] = x
                                moves.append(moved)
                for i, j in pairs:  # two boundaries at once: work moves between chunks that are not neighbours
                    for di, dj in shifts:
                        moved = at.copy()
                        moved[i] += di
                        moved[j] += dj
                        if moved[i - 1] < moved[i] < moved[i + 1] and moved[j - 1] < moved[j] < moved[j + 1]:
                            moves.append(moved)
                    for d in (-1, 1):  # or every boundary from i to j: one layer from before i to after j
                        moved = at[:i] + [x + d for x in at[i : j + 1]] + at[j + 1 :]
                        if moved[i - 1] < moved[i] and moved[j] < moved[j + 1]:
                            moves.append(moved)
                if not moves:
                    break
                moves = np.array(moves, dtype=np.int64)
                steps = self.evaluate(np.vstack([cut[None, :], moves]) if current is None else moves)
                if current is None:
                    current, steps = float(steps[0]), steps[1:]
                i = int(np.argmin(steps))
                if not steps[i] < current * (1 - TIE):
                    break
                cut, current = moves[i], float(steps[i])

    def _threshold(self, u: float, enumerate_work: int) -> bool:
        """Simulate every cut whose bounds are all <= u, if few: then the best is proven optimal."""
        n = self.c.n
        if n * self.k > THRESHOLD_SIZE:  # at this size the cuts under the best step are countless anyway
            return False
        b = np.arange(n + 1)
        lo_arrays = [np.minimum(self.lo(s, b, u), b) for s in range(self.k)]
        most = enumerate_work // (self.ops)
        if count_cuts(n, self.k, lo_arrays, most + 1) > most:
            return False
        self.evaluate(enumerate_cuts(n, self.k, lo_arrays))
        return True

    def _solution(self, *, exact: bool, bound: float = 0.0) -> StepSolution:
        if self.best is None:
            raise NoCutFits
        low, _, _, step, cut, modes = self.best
        lower = low if exact else min(bound, low)
        return StepSolution(cut, modes, step, lower, exact or lower >= low, self.simulated, self.probes)


def _all_cuts(n: int, k: int, block: int):
    """Every cut into k non-empty chunks, as blocks of rows of k + 1 boundaries."""
    it = itertools.combinations(range(1, n), k - 1)
    while True:
        rows = list(itertools.islice(it, block))
        if not rows:
            return
        inner = np.array(rows, dtype=np.int64).reshape(len(rows), k - 1)
        yield np.hstack([np.zeros((len(rows), 1), dtype=np.int64), inner, np.full((len(rows), 1), n, dtype=np.int64)])


