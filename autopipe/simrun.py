"""How the simulator runs (autopipe/schedule.py says what it runs): no torch.

Fixed orders (gpipe, 1f1b, interleaved). With each rank's order fixed, an op starts at max(end of
the op before it on its rank, end of the op on another chunk it waits for) and lasts its duration;
its own F, the third input of a B, is earlier on the same rank. That is a longest path in a DAG
whose shape depends only on (schedule, ranks, virtual, micro-batches), so it is compiled once into
levels (ops whose inputs are all on earlier levels) and evaluated with one vectorised max-plus step
per level, for one cut or many at once (a column each). These are the same additions and maxima the
event loop did, in the same order, so the floats are identical.

zbv. A rank picks its next op when it is free: a ready B (deeper chunk first), else a ready F (the
shallow chunk only while it holds fewer than ``cap`` micro-batches), else its oldest deferred W. The
choice depends on the costs, so this one runs as events. Ranks free at the same instant choose in
rank order, and after any op starts the lowest-numbered free rank chooses again. A rank that can
start nothing waits for the ops it needs (the next B's input from the deeper chunk, the next F's
input from the shallower one) instead of retrying at every event: nothing else can unblock it.
"""

from __future__ import annotations

import collections
import heapq
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = ["Program", "compile_orders", "run_fixed", "timeline_of", "fixed_durations", "zbv_durations", "run_zbv"]

# An entry of a rank's timeline: (start, end, kind "F"/"B"/"W", micro-batch, chunk).
TimelineEntry = tuple[float, float, str, int, int]


@dataclass(frozen=True)
class Program:
    ops: tuple[tuple[str, int, int], ...]  # rank-major: rank 0's order, then rank 1's, ...
    kind: np.ndarray  # 0 for F, 1 for B
    chunk: np.ndarray
    prev: np.ndarray  # the op before it on its rank; n (an always-zero slot) for a rank's first op
    dep: np.ndarray  # the op on another chunk it waits for; n for none
    levels: tuple[np.ndarray, ...]
    bounds: tuple[int, ...]  # rank r's ops are ops[bounds[r]:bounds[r + 1]]
    last: np.ndarray  # each rank's last op


def compile_orders(orders: list[list[tuple[str, int, int]]], k: int) -> Program:
    """The op graph of fixed per-rank orders over k chunks, in levels (see the module docstring)."""
    ranks = len(orders)
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
            raise RuntimeError("a cyclic op order")  # a bug in an order, not user input
    lv = np.array(level[:n])
    order = np.argsort(lv, kind="stable")
    cuts = np.searchsorted(lv[order], np.arange(int(lv.max(initial=-1)) + 2))
    return Program(
        ops=tuple(ops),
        kind=np.array([op[0] == "B" for op in ops], dtype=np.int8),
        chunk=np.array([op[2] for op in ops], dtype=np.int64),
        prev=np.array(prev, dtype=np.int64),
        dep=np.array(dep, dtype=np.int64),
        levels=tuple(order[a:b] for a, b in zip(cuts, cuts[1:])),
        bounds=tuple(bounds),
        last=np.array(bounds[1:], dtype=np.int64) - 1,
    )


def fixed_durations(forward: Sequence[float], backward: Sequence[float], comm: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per chunk, F and B seconds: the same sums as the op durations of the event loop."""
    k = len(forward)
    return [float(forward[c] + comm[c]) for c in range(k)], [float(backward[c] + comm[c]) for c in range(k)]


def run_fixed(prog: Program, fwd: np.ndarray, bwd: np.ndarray, *, starts: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
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


def timeline_of(prog: Program, start: np.ndarray, end: np.ndarray) -> list[list[TimelineEntry]]:
    s, e = start.tolist(), end.tolist()
    ops, b = prog.ops, prog.bounds
    return [[(s[i], e[i], *ops[i]) for i in range(b[r], b[r + 1])] for r in range(len(b) - 1)]


def zbv_durations(forward: Sequence[float], backward: Sequence[float], comm: Sequence[float],
                   weight_share: float) -> tuple[list[float], list[float], list[float]]:  # fmt: skip
    k = len(forward)
    f = [float(forward[c] + comm[c]) for c in range(k)]
    b = [float(backward[c] * (1 - weight_share) + comm[c]) for c in range(k)]
    w = [float(backward[c] * weight_share) for c in range(k)]
    return f, b, w


def run_zbv(ranks: int, m: int, cap: int, fdur: list[float], bdur: list[float], wdur: list[float],
            *, timeline: bool) -> Any:  # fmt: skip
    """The greedy zbv step: its per-rank timeline, or only the step time when ``timeline`` is False."""
    k = 2 * ranks
    inf = float("inf")
    end = [inf] * (3 * k * m)  # op ids: F(i, c) = c*m + i, B(i, c) = (k + c)*m + i, W(i, c) = (2k + c)*m + i
    waiters: dict[int, list[int]] = {}
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


