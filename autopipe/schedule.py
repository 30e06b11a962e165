"""Pipeline schedule simulator: step time, bubble and timeline from per-chunk costs. No torch.

A pipeline of ``ranks`` devices runs ``chunks = ranks * virtual`` model chunks. Each micro-batch goes
forward (F) through chunks 0..K-1 and backward (B) through K-1..0; zero-bubble schedules split the
backward into B (input gradient, on the critical path) and W (weight gradient, deferrable).

Costs follow the partition's model: the send/recv time of a chunk's cuts is charged to the op itself
(serialised with compute), so an F of chunk c lasts ``forward[c] + comm[c]`` and so does a B with
``backward[c]``. Every op starts when its rank is free and its inputs are done.

Schedules (placement of chunk c on a rank, and each rank's order of ops):

- ``gpipe``: all forwards, then all backwards; one chunk per rank.
- ``1f1b``: ``ranks - r - 1`` warm-up forwards on rank r, then one forward / one backward.
- ``interleaved1f1b``: v chunks per rank, chunk c on rank ``c % ranks``; Megatron's order
  (warm-up ``2(ranks - r - 1) + (v - 1) ranks`` units, then 1F1B over (micro-batch, chunk) units).
- ``zbv``: two chunks per rank in a V (chunk c on rank c, chunk 2R-1-c on rank c), split backward;
  a greedy rank runs a ready B first, then a ready F (the shallow chunk only while it holds fewer
  than 2R micro-batches), and fills idle time with deferred W (the zero-bubble idea; not the
  paper's exact hand-made order).

How. The fixed orders (gpipe, 1f1b, interleaved) are a longest-path recurrence: an op ends at
max(end of the op before it on its rank, end of its input on another chunk) + its duration. Its
graph depends only on (schedule, ranks, virtual stages, micro-batches), so it is compiled once into
levels and evaluated with one numpy max-plus step per level: O(ops) work, O(M + S·v) numpy calls,
and :func:`step_times` evaluates many cuts in the same calls. zbv's order depends on the costs, so it
runs as events, O(ops log ranks): a rank that can start nothing sleeps until the op it waits for
ends. Both give the floats the former event loop gave, timelines included (tests/_event_sim.py).

Example:
    >>> sim = simulate("gpipe", forward=[1, 1], backward=[2, 2], comm=[0, 0], ranks=2, microbatches=4)
    >>> sim.step_time  # (M + S - 1) * (f + b)
    15.0
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from .errors import PartitionError

__all__ = [
    "SCHEDULES",
    "Simulation",
    "normalize_schedule",
    "check_schedule",
    "check_weight_share",
    "chunk_ranks",
    "simulate",
    "step_times",
    "inflight_counts",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv")
_ALIASES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved": "interleaved1f1b",
    "interleaved1f1b": "interleaved1f1b",
    "zbv": "zbv",
    "zbvzerobubble": "zbv",
    "zero-bubble": "zbv",
}

# An entry of a rank's timeline: (start, end, kind "F"/"B"/"W", micro-batch, chunk).
TimelineEntry = tuple[float, float, str, int, int]


@dataclass(frozen=True)
class Simulation:
    """One simulated training step: its length, idle share and every op's place in time."""

    schedule: str
    ranks: int
    microbatches: int
    step_time: float
    bubble_fraction: float  # idle share of ranks × step_time
    busy: tuple[float, ...]  # seconds each rank computes
    timeline: tuple[tuple[TimelineEntry, ...], ...]  # per rank, in start order

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def normalize_schedule(name: str) -> str:
    """Canonical schedule name ("1F1B" -> "1f1b", "Interleaved1F1B" -> "interleaved1f1b", ...)."""
    key = name.lower().replace("_", "").replace("schedule", "")
    try:
        return _ALIASES[key]
    except KeyError:
        raise PartitionError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}.") from None


def check_schedule(schedule: str, ranks: int, virtual: int, microbatches: int) -> str:
    """Validate the (schedule, virtual stages, micro-batches) combination; returns the canonical name."""
    schedule = normalize_schedule(schedule)
    for label, value in (("stages", ranks), ("micro-batches", microbatches), ("virtual stages", virtual)):
        if value < 1:
            raise PartitionError(f"{label} must be at least 1, got {value}.")
    if schedule in ("gpipe", "1f1b") and virtual != 1:
        raise PartitionError(
            f"schedule {schedule} runs one chunk per rank, but virtual_stages={virtual}; "
            "use schedule='interleaved1f1b' (or 'zbv' with 2) for virtual stages."
        )
    if schedule == "interleaved1f1b":
        if virtual < 2:
            raise PartitionError("interleaved1f1b needs virtual_stages >= 2; use '1f1b' for one chunk per rank.")
        if microbatches % ranks:
            raise PartitionError(
                f"interleaved1f1b needs micro-batches to be a multiple of the stages "
                f"({microbatches} % {ranks} != 0); use {(microbatches // ranks + 1) * ranks} micro-batches."
            )
    if schedule == "zbv" and virtual != 2:
        raise PartitionError(f"zbv places exactly 2 chunks per rank (a V), got virtual_stages={virtual}.")
    return schedule


def check_weight_share(weight_share: float) -> None:
    """The W part of a backward is a share of it: between 0 and 1."""
    if not 0.0 <= weight_share <= 1.0:  # also refuses nan
        raise PartitionError(
            f"weight_share must be between 0 and 1, got {weight_share}; it is the part of the backward that is "
            "weight gradient (0.5 when unknown)."
        )


def chunk_ranks(schedule: str, ranks: int, virtual: int) -> tuple[int, ...]:
    """The rank that runs each chunk: round-robin (c % ranks), or a V for zbv."""
    if normalize_schedule(schedule) == "zbv":
        return tuple(c if c < ranks else 2 * ranks - 1 - c for c in range(2 * ranks))
    return tuple(c % ranks for c in range(ranks * virtual))


def _fixed_orders(schedule: str, ranks: int, virtual: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's op order (kind, micro-batch, chunk) for the schedules with a fixed order."""
    orders = []
    for r in range(ranks):
        if schedule == "gpipe":
            order = [("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)]
        elif schedule == "1f1b":
            warm = min(ranks - r - 1, m)
            fw = [("F", i, r) for i in range(m)]
            bw = [("B", i, r) for i in range(m)]
            order = _one_f_one_b(fw, bw, warm)
        else:  # interleaved: units of (micro-batch, local chunk), S micro-batches per chunk in turn
            fw, bw = [], []
            for k in range(m * virtual):
                mb = (k // (ranks * virtual)) * ranks + k % ranks
                j = (k // ranks) % virtual
                fw.append(("F", mb, j * ranks + r))
                bw.append(("B", mb, (virtual - 1 - j) * ranks + r))
            warm = min((ranks - r - 1) * 2 + (virtual - 1) * ranks, m * virtual)
            order = _one_f_one_b(fw, bw, warm)
        orders.append(order)
    return orders


def _one_f_one_b(fw: list, bw: list, warm: int) -> list:
    """Warm-up forwards, then alternate one forward and one backward, then the remaining backwards."""
    order = fw[:warm]
    for i in range(len(fw) - warm):
        order += [fw[warm + i], bw[i]]
    return order + bw[len(fw) - warm :]


def simulate(
    schedule: str,
    *,
    forward: Sequence[float],
    backward: Sequence[float],
    comm: Sequence[float],
    ranks: int,
    microbatches: int,
    weight_share: float = 0.5,
) -> Simulation:
    """Simulate one step of ``schedule`` over chunks with the given per-chunk seconds.

    ``forward``, ``backward`` and ``comm`` have one value per chunk (ranks × virtual stages);
    ``comm[c]`` is chunk c's send+recv seconds per direction. ``weight_share`` is the part of the
    backward that is weight gradient (W), split off by zero-bubble schedules only.
    """
    schedule, k, virtual = _check_costs(schedule, forward, backward, comm, ranks, microbatches, weight_share)
    if schedule == "zbv":
        timeline = _zbv_run(ranks, microbatches, *_zbv_durations(forward, backward, comm, weight_share), timeline=True)
    else:
        prog = _program(schedule, ranks, virtual, microbatches)
        fwd, bwd = _fixed_durations(forward, backward, comm)
        start, end = _run(prog, np.array(fwd), np.array(bwd))
        timeline = _timeline(prog, start, end)
    step = max((tl[-1][1] for tl in timeline if tl), default=0.0)
    busy = tuple(sum(e - s for s, e, *_ in tl) for tl in timeline)
    bubble = 1.0 - sum(busy) / (ranks * step) if step > 0 else 0.0
    return Simulation(schedule, ranks, microbatches, step, bubble, busy, tuple(tuple(tl) for tl in timeline))


def step_times(
    schedule: str,
    *,
    forward: np.ndarray,
    backward: np.ndarray,
    comm: np.ndarray,
    ranks: int,
    microbatches: int,
    weight_share: float = 0.5,
) -> np.ndarray:
    """The simulated step of many cuts at once: rows of per-chunk seconds in, one step per row out.

    Equal to ``simulate(...).step_time`` row by row (the same additions in the same order), but the
    fixed orders run all rows together: one numpy operation per dependency level of the op graph.
    """
    fwd = np.atleast_2d(np.asarray(forward, dtype=np.float64))
    bwd = np.atleast_2d(np.asarray(backward, dtype=np.float64))
    com = np.atleast_2d(np.asarray(comm, dtype=np.float64))
    n, k = fwd.shape
    schedule, k, virtual = _check_costs(schedule, fwd[0], bwd[0], com[0], ranks, microbatches, weight_share)
    if schedule == "zbv":
        out = np.empty(n)
        for i in range(n):
            durations = _zbv_durations(fwd[i].tolist(), bwd[i].tolist(), com[i].tolist(), weight_share)
            out[i] = _zbv_run(ranks, microbatches, *durations, timeline=False)
        return out
    prog = _program(schedule, ranks, virtual, microbatches)
    rows = max(1, _BATCH // len(prog.ops))  # rows per pass: ops x rows floats stay in cache-sized blocks
    out = np.empty(n)
    for i in range(0, n, rows):
        end = _run(prog, (fwd[i : i + rows] + com[i : i + rows]).T, (bwd[i : i + rows] + com[i : i + rows]).T, starts=False)[1]
        out[i : i + rows] = end[prog.last].max(axis=0)
    return out


_BATCH = 1 << 18  # op evaluations per numpy pass in step_times


def _check_costs(schedule: str, forward: Sequence[float], backward: Sequence[float], comm: Sequence[float],
                 ranks: int, microbatches: int, weight_share: float) -> tuple[str, int, int]:  # fmt: skip
    k = len(forward)
    if len(backward) != k or len(comm) != k or k % ranks:
        raise PartitionError(f"simulate: need one forward/backward/comm value per chunk, a multiple of {ranks}.")
    virtual = k // ranks
    schedule = check_schedule(schedule, ranks, virtual, microbatches)
    check_weight_share(weight_share)
    return schedule, k, virtual


# ---- fixed orders: a longest-path recurrence ------------------------------------------------------
#
# With each rank's order fixed, an op starts at max(end of the op before it on its rank, end of the op
# on another chunk it waits for) and lasts its duration; its own F, the third dependency of a B, is
# earlier on the same rank. That is a longest path in a DAG whose shape depends only on (schedule,
# ranks, virtual, micro-batches), so it is compiled once into "levels" (ops whose inputs are all on
# earlier levels) and evaluated with one vectorised max-plus step per level. These are the same
# additions and maxima the event loop did, so the floats are identical.


@dataclass(frozen=True)
class _Program:
    ops: tuple[tuple[str, int, int], ...]  # rank-major: rank 0's order, then rank 1's, ...
    kind: np.ndarray  # 0 for F, 1 for B
    chunk: np.ndarray
    prev: np.ndarray  # the op before it on its rank; n (an always-zero slot) for a rank's first op
    dep: np.ndarray  # the op on another chunk it waits for; n for none
    levels: tuple[np.ndarray, ...]
    bounds: tuple[int, ...]  # rank r's ops are ops[bounds[r]:bounds[r + 1]]
    last: np.ndarray  # each rank's last op


@lru_cache(maxsize=16)
def _program(schedule: str, ranks: int, virtual: int, m: int) -> _Program:
    orders = _fixed_orders(schedule, ranks, virtual, m)
    k = ranks * virtual
    ops = [op for order in orders for op in order]
    n = len(ops)
    where = {op: i for i, op in enumerate(ops)}
    bounds = [0]
    for order in orders:
        bounds.append(bounds[-1] + len(order))
    prev = list(range(-1, n - 1))
    for b in bounds[:-1]:
        prev[b] = n
    dep = [n] * n
    for i, (kind, mb, c) in enumerate(ops):
        if kind == "F" and c > 0:
            dep[i] = where[("F", mb, c - 1)]
        elif kind == "B" and c < k - 1:
            dep[i] = where[("B", mb, c + 1)]
    # Levels by a topological pass: advance each rank while the op it is at has its input done.
    level = [0] * (n + 1)
    level[n] = -1
    done = [False] * n + [True]
    at = bounds[:-1]
    left = n
    while left:
        moved = left
        for r in range(ranks):
            i, stop = at[r], bounds[r + 1]
            while i < stop and done[dep[i]]:
                level[i] = max(level[prev[i]], level[dep[i]]) + 1
                done[i] = True
                i += 1
            left -= i - at[r]
            at[r] = i
        if left == moved:
            raise RuntimeError(f"schedule {schedule} has a cyclic op order")  # a bug, not user input
    lv = np.array(level[:n])
    order = np.argsort(lv, kind="stable")
    cuts = np.searchsorted(lv[order], np.arange(int(lv.max(initial=-1)) + 2))
    return _Program(
        ops=tuple(ops),
        kind=np.array([op[0] == "B" for op in ops], dtype=np.int8),
        chunk=np.array([op[2] for op in ops], dtype=np.int64),
        prev=np.array(prev, dtype=np.int64),
        dep=np.array(dep, dtype=np.int64),
        levels=tuple(order[a:b] for a, b in zip(cuts, cuts[1:])),
        bounds=tuple(bounds),
        last=np.array(bounds[1:], dtype=np.int64) - 1,
    )


def _fixed_durations(forward: Sequence[float], backward: Sequence[float], comm: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per chunk, F and B seconds: the same sums as the op durations of the event loop."""
    k = len(forward)
    return [float(forward[c] + comm[c]) for c in range(k)], [float(backward[c] + comm[c]) for c in range(k)]


def _run(prog: _Program, fwd: np.ndarray, bwd: np.ndarray, *, starts: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
    """Start (when asked) and end of every op, plus the zero slot; ``fwd``/``bwd`` are (chunks,) or (chunks, rows)."""
    dur = np.where((prog.kind == 0).reshape((-1,) + (1,) * (fwd.ndim - 1)), fwd[prog.chunk], bwd[prog.chunk])
    n = len(prog.ops)
    end = np.zeros((n + 1,) + fwd.shape[1:])
    start = np.zeros_like(end) if starts else None
    prev, dep = prog.prev, prog.dep
    for idx in prog.levels:
        s = np.maximum(end[prev[idx]], end[dep[idx]])
        if starts:
            start[idx] = s
        end[idx] = s + dur[idx]
    return start, end


def _timeline(prog: _Program, start: np.ndarray, end: np.ndarray) -> list[list[TimelineEntry]]:
    s, e = start.tolist(), end.tolist()
    ops, b = prog.ops, prog.bounds
    return [[(s[i], e[i], *ops[i]) for i in range(b[r], b[r + 1])] for r in range(len(b) - 1)]


# ---- zbv: the greedy order, event by event ---------------------------------------------------------
#
# A zbv rank picks its next op when it is free: a ready B (deeper chunk first), else a ready F (the
# shallow chunk only while it holds fewer than 2R micro-batches), else its oldest deferred W. The
# choice depends on the costs, so this one runs as events. Ranks free at the same instant choose in
# rank order, and after any op starts the lowest-numbered free rank chooses again. A rank that can
# start nothing waits for the ops it needs (the next B's input from the deeper chunk, the next F's
# input from the shallower one) instead of retrying at every event: nothing else can unblock it.


def _zbv_durations(forward: Sequence[float], backward: Sequence[float], comm: Sequence[float],
                   weight_share: float) -> tuple[list[float], list[float], list[float]]:  # fmt: skip
    k = len(forward)
    f = [float(forward[c] + comm[c]) for c in range(k)]
    b = [float(backward[c] * (1 - weight_share) + comm[c]) for c in range(k)]
    w = [float(backward[c] * weight_share) for c in range(k)]
    return f, b, w


def _zbv_run(ranks: int, m: int, fdur: list[float], bdur: list[float], wdur: list[float],
             *, timeline: bool) -> Any:  # fmt: skip
    """The greedy zbv step: its per-rank timeline, or only the step time when ``timeline`` is False."""
    k = 2 * ranks
    inf = float("inf")
    end = [inf] * (3 * k * m)  # op ids: F(i, c) = c*m + i, B(i, c) = (k + c)*m + i, W(i, c) = (2k + c)*m + i
    waiters: dict[int, list[int]] = {}
    cap = _zbv_cap(ranks)
    next_f = [0] * k
    next_b = [0] * k
    held = [0] * ranks
    pending: list[collections.deque] = [collections.deque() for _ in range(ranks)]
    left = [6 * m] * ranks
    wake = [0.0] * ranks
    queued = [False] * ranks
    blocked = [False] * ranks
    lines: list[list[TimelineEntry]] = [[] for _ in range(ranks)]
    events = [(0.0, r) for r in range(ranks)]
    push, pop = heapq.heappush, heapq.heappop
    step = 0.0
    while events:
        now, r = pop(events)
        if wake[r] != now or queued[r]:
            continue  # a stale wake-up
        free = [r]
        queued[r] = True
        while events and events[0][0] == now:  # every rank free at this instant, chosen in rank order
            _, q = pop(events)
            if wake[q] == now and not queued[q]:
                queued[q] = True
                push(free, q)
        while free:
            r = pop(free)
            queued[r] = False
            shallow, deep = r, k - 1 - r
            op = -1
            for c in (deep, shallow):  # a ready B, the deeper chunk first
                i = next_b[c]
                if i < m and end[c * m + i] <= now and (c == k - 1 or end[(k + c + 1) * m + i] <= now):
                    next_b[c] = i + 1
                    pending[r].append((i, c))
                    op, kind, mb, ch, dur = (k + c) * m + i, "B", i, c, bdur[c]
                    break
            if op < 0:
                for c in (deep, shallow):  # a ready F, the shallow chunk under its cap
                    i = next_f[c]
                    if i < m and (c != shallow or held[r] < cap) and (c == 0 or end[(c - 1) * m + i] <= now):
                        next_f[c] = i + 1
                        if c == shallow:
                            held[r] += 1
                        op, kind, mb, ch, dur = c * m + i, "F", i, c, fdur[c]
                        break
            if op < 0 and pending[r]:  # a deferred W
                i, c = pending[r].popleft()
                if c == shallow:
                    held[r] -= 1
                op, kind, mb, ch, dur = (2 * k + c) * m + i, "W", i, c, wdur[c]
            if op < 0:  # blocked: wait for the other ranks' ops the next B and F of each chunk need
                wake[r] = inf
                blocked[r] = True
                for c in (deep, shallow):
                    i = next_b[c]  # its own F first (else the F below is what waits), then the deeper B
                    if i < m and c + 1 != deep and c < k - 1 and end[c * m + i] <= now:
                        _await(r, (k + c + 1) * m + i, end, wake, waiters, events)
                    i = next_f[c]
                    if i < m and c - 1 != shallow and c > 0 and (c != shallow or held[r] < cap):
                        _await(r, (c - 1) * m + i, end, wake, waiters, events)
                continue
            blocked[r] = False
            finish = now + dur
            end[op] = finish
            left[r] -= 1
            if timeline:
                lines[r].append((now, finish, kind, mb, ch))
            if finish > step:
                step = finish
            if op in waiters:
                for w in waiters.pop(op):
                    if blocked[w] and finish < wake[w]:
                        wake[w] = finish
                        if finish != now:
                            push(events, (finish, w))
                        elif not queued[w]:
                            queued[w] = True
                            push(free, w)
            if left[r]:
                wake[r] = finish
                if finish != now:
                    push(events, (finish, r))
                else:
                    queued[r] = True
                    push(free, r)
    if any(left):
        raise RuntimeError("schedule zbv deadlocked")  # a bug, not user input
    return lines if timeline else step


def _await(r: int, op: int, end: list[float], wake: list[float], waiters: dict[int, list[int]], events: list) -> None:
    """Blocked rank r needs another rank's op: wake it when that op ends (known, or once it starts)."""
    if end[op] == float("inf"):
        waiters.setdefault(op, []).append(r)
    elif end[op] < wake[r]:  # running now (a finished one would have made r's op ready)
        wake[r] = end[op]
        heapq.heappush(events, (end[op], r))


def inflight_counts(schedule: str, ranks: int, virtual: int, microbatches: int) -> list[int]:
    """Per chunk, the most micro-batches whose activations it may hold at once under ``schedule``.

    A unit is held from its F to its B (to its W when the backward is split). GPipe, 1F1B and
    interleaved run a fixed op order, so the count is read off that order and holds for any costs:
    M for GPipe, min(S - s, M) for 1F1B. The greedy zbv order depends on the costs, so it gets a
    bound instead: min(M, 2S) on every chunk. The shallow chunk of a rank is capped at 2S units
    (F to W); a unit reaches the deep chunk only after the shallow one's F, and its deep W runs
    before its shallow W (W follows B order, and the deep B comes first), so the deep chunk never
    holds more than the shallow one. Equal costs stay below the bound on the deep chunks, which is
    why simulating them undercounts.
    """
    schedule = check_schedule(schedule, ranks, virtual, microbatches)
    k = ranks * virtual
    if schedule == "zbv":
        return [min(microbatches, _zbv_cap(ranks))] * k
    peak = [0] * k
    for order in _fixed_orders(schedule, ranks, virtual, microbatches):
        held = [0] * k
        for kind, _, c in order:
            if kind == "F":
                held[c] += 1
                peak[c] = max(peak[c], held[c])
            else:
                held[c] -= 1
    return peak


def _zbv_cap(ranks: int) -> int:
    """Micro-batches the greedy zbv lets a rank's shallow chunk hold (F done, W not yet)."""
    return 2 * ranks
