"""How the simulator runs (autopipe/planner/schedules.py says what it runs): no torch.

Fixed orders (gpipe, 1f1b, interleaved, and zbv as torch's ZBVZeroBubble orders it). With each
rank's order fixed, an op starts at max(end of the op before it on its rank, end of the op on another
chunk it waits for) and lasts its duration; its own F, the third input of a B, and its own B, the
input of a W (zbv's deferred weight gradient), are earlier on the same rank. That is a longest path in a DAG
whose shape depends only on (schedule, ranks, virtual, micro-batches), so it is compiled once into
levels (ops whose inputs are all on earlier levels) and evaluated with one vectorised max-plus step
per level, for one cut or many at once (a column each). These are the same additions and maxima the
event loop did, in the same order, so the floats are identical.

"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Program", "compile_orders", "durations", "run_fixed", "run_shared", "timeline_of"]

# An entry of a rank's timeline: (start, end, kind "F"/"B"/"W", micro-batch, chunk).
TimelineEntry = tuple[float, float, str, int, int]


@dataclass(frozen=True)
class Program:
    ops: tuple[tuple[str, int, int], ...]  # rank-major: rank 0's order, then rank 1's, ...
    kind: np.ndarray  # 0 for F, 1 for B, 2 for W
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
        kind=np.array([{"F": 0, "B": 1, "W": 2}[op[0]] for op in ops], dtype=np.int8),
        chunk=np.array([op[2] for op in ops], dtype=np.int64),
        prev=np.array(prev, dtype=np.int64),
        dep=np.array(dep, dtype=np.int64),
        levels=tuple(order[a:b] for a, b in zip(cuts, cuts[1:])),
        bounds=tuple(bounds),
        last=np.array(bounds[1:], dtype=np.int64) - 1,
    )


def durations(forward: np.ndarray, backward: np.ndarray, comm: np.ndarray, *,
              split: float | np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:  # fmt: skip
    """F, B and W seconds per chunk (arrays of (chunks,) or (chunks, rows)): send/recv is charged to F
    and B; with ``split`` (zero-bubble's weight share, one for all chunks or one per chunk) B keeps
    (1 - split) of the backward and W, which sends nothing, the rest; else there is no W. One function
    for simulate and step_times, so their floats agree."""
    if split is None:
        return forward + comm, backward + comm, None
    share = np.asarray(split, dtype=np.float64)
    if share.ndim == 1 and backward.ndim == 2:
        share = share[:, None]
    return forward + comm, backward * (1 - share) + comm, backward * share


def run_fixed(prog: Program, fwd: np.ndarray, bwd: np.ndarray, wgt: np.ndarray | None = None, *,
              starts: bool = True) -> tuple[np.ndarray | None, np.ndarray]:  # fmt: skip
    """Start (when asked) and end of every op, plus the zero slot; ``fwd``/``bwd``/``wgt`` (W, zbv
    only) are (chunks,) or (chunks, rows)."""
    dur = _op_durations(prog, fwd, bwd, wgt)
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


def _op_durations(prog: Program, fwd: np.ndarray, bwd: np.ndarray, wgt: np.ndarray | None) -> np.ndarray:
    """Each op's seconds (one row per op; a column per cut when the chunk arrays have columns)."""
    # one gather from the stacked (F; B; W) rows: op i reads row kind_i * chunks + chunk_i
    parts = np.broadcast_arrays(fwd, bwd) if wgt is None else np.broadcast_arrays(fwd, bwd, wgt)
    k = parts[0].shape[0]
    table = np.concatenate(parts)
    return table[prog.kind.astype(np.int64) * k + prog.chunk]


def run_shared(prog: Program, fwd: np.ndarray, bwd: np.ndarray, wgt: np.ndarray | None, cores: float) -> float:
    """The step when the ranks, one thread each, share ``cores`` cores (a CPU with fewer cores than
    ranks): each rank runs its fixed order, an op starts when its rank's previous op and its input on
    another chunk are done, and the ops running at once share the cores evenly, each at most one
    (processor sharing). A rank waiting on another leaves its share to the running ones, so a bubble
    costs less than on dedicated devices and the step tends to the work over the cores.
    ``fwd``/``bwd``/``wgt`` are (chunks,), as ``durations`` gives them."""
    dur = _op_durations(prog, fwd, bwd, wgt)
    left = dur.astype(np.float64).tolist()
    n, dep = len(prog.ops), prog.dep.tolist()
    done = [False] * n + [True]
    at = list(prog.bounds[:-1])
    stop = prog.bounds[1:]
    now = 0.0
    while True:
        running = [r for r in range(len(at)) if at[r] < stop[r] and done[dep[at[r]]]]
        if not running:
            if any(at[r] < stop[r] for r in range(len(at))):
                raise RuntimeError("a cyclic op order")  # a bug in an order, not user input
            return now
        rate = min(1.0, cores / len(running))
        dt = min(left[at[r]] for r in running) / rate
        now += dt
        for r in running:
            i = at[r]
            left[i] -= dt * rate
            if left[i] <= 1e-12 * (1.0 + dur[i]):
                done[i] = True
                at[r] += 1


def timeline_of(prog: Program, start: np.ndarray, end: np.ndarray) -> list[list[TimelineEntry]]:
    s, e = start.tolist(), end.tolist()
    ops, b = prog.ops, prog.bounds
    return [[(s[i], e[i], *ops[i]) for i in range(b[r], b[r + 1])] for r in range(len(b) - 1)]
