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
- ``zbv``: two chunks per rank in a V (chunk c on rank c, chunk 2R-1-c on rank c), split backward
  (B, then the deferred weight gradient W), in the order torch's ``ScheduleZBVZeroBubble`` runs
  (``zbv_order``; ZB-V, Qi et al. 2024): what train.py executes, so what the plan times and charges.
  (Until 2026-11-22 zbv was timed with a greedy order of autopipe's own, which torch never ran.)

How. Every order is fixed, so a step is a longest-path recurrence: an op ends at max(end of the op
before it on its rank, end of its input on another chunk) + its duration. Its graph depends only on
(schedule, ranks, virtual stages, micro-batches), so it is compiled once into levels and evaluated
with one numpy max-plus step per level: O(ops) work, O(M + S·v) numpy calls, and :func:`step_times`
evaluates many cuts in the same calls. It gives the floats the former event loop gave, timelines
included (tests/_event_sim.py).

Example:
    >>> sim = simulate("gpipe", forward=[1, 1], backward=[2, 2], comm=[0, 0], ranks=2, microbatches=4)
    >>> sim.step_time  # (M + S - 1) * (f + b)
    15.0
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np

from ..errors import PartitionError
from .simulator import (
    Program,
    TimelineEntry,
    compile_orders,
    durations,
    run_fixed,
    run_shared,
    timeline_of,
)

__all__ = [
    "SCHEDULES",
    "rank_ends",
    "Simulation",
    "normalize_schedule",
    "check_schedule",
    "check_weight_share",
    "chunk_ranks",
    "place_chunks",
    "simulate",
    "shared_step",
    "step_times",
    "inflight_counts",
    "peak_states",
    "rank_states",
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
    """The rank that runs each chunk of a planned schedule: round-robin (c % ranks), or a V for zbv."""
    v_shaped = normalize_schedule(schedule) == "zbv"
    return place_chunks(ranks, 2 * ranks if v_shaped else ranks * virtual, v_shaped=v_shaped)


def place_chunks(ranks: int, chunks: int, *, v_shaped: bool) -> tuple[int, ...]:
    """The one rule for which pipeline rank runs each chunk, the planner's and the runtime's alike:
    round-robin (chunk c on rank c % ranks), or down and back up for a V-shaped schedule (rank r
    holds chunks r and 2·ranks-1-r), as torch.distributed.pipelining places its stages.

    >>> place_chunks(3, 6, v_shaped=False), place_chunks(3, 6, v_shaped=True)
    ((0, 1, 2, 0, 1, 2), (0, 1, 2, 2, 1, 0))
    """
    if v_shaped:
        return tuple(c if c < ranks else 2 * ranks - 1 - c for c in range(chunks))
    return tuple(c % ranks for c in range(chunks))


def fixed_orders(schedule: str, ranks: int, virtual: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's op order (kind, micro-batch, chunk)."""
    orders = []
    for r in range(ranks):
        if schedule == "zbv":
            order = zbv_order(ranks, m, r)
        elif schedule == "gpipe":
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
    schedule, prog, ops = _compiled(schedule, forward, backward, comm, ranks, microbatches, weight_share)
    start, end = run_fixed(prog, *ops)
    timeline = timeline_of(prog, start, end)
    step = max((tl[-1][1] for tl in timeline if tl), default=0.0)
    busy = tuple(sum(e - s for s, e, *_ in tl) for tl in timeline)
    bubble = 1.0 - sum(busy) / (ranks * step) if step > 0 else 0.0
    return Simulation(schedule, ranks, microbatches, step, bubble, busy, tuple(tuple(tl) for tl in timeline))


def rank_ends(schedule: str, *, forward: Sequence[float], backward: Sequence[float], comm: Sequence[float],
              ranks: int, microbatches: int, weight_share: float = 0.5) -> tuple[float, ...]:
    """When each rank's last op ends: ``simulate(...).timeline[r][-1][1]`` for every rank r (0.0 for a
    rank with no ops), the same floats, without building the timeline (the cluster search asks this of
    every layout it solves, and a 70B layout's timeline holds ~10^4 ops).

    >>> args = dict(forward=[1.0, 1.0], backward=[2.0, 2.0], comm=[0.0, 0.0], microbatches=4)
    >>> rank_ends("1f1b", ranks=2, **args) == tuple(tl[-1][1] for tl in simulate("1f1b", ranks=2, **args).timeline)
    True
    """
    _, prog, ops = _compiled(schedule, forward, backward, comm, ranks, microbatches, weight_share)
    end = run_fixed(prog, *ops, starts=False)[1].tolist()
    return tuple(end[prog.last[r]] if prog.bounds[r + 1] > prog.bounds[r] else 0.0 for r in range(ranks))


def shared_step(
    schedule: str,
    *,
    forward: Sequence[float],
    backward: Sequence[float],
    comm: Sequence[float],
    ranks: int,
    microbatches: int,
    cores: float,
    weight_share: float = 0.5,
) -> float:
    """``simulate``'s step when the ``ranks`` share ``cores`` cores (one thread each; see
    ``simulator.run_shared``). With ``cores >= ranks`` it equals ``simulate(...).step_time``.

    >>> args = dict(forward=[1, 1], backward=[2, 2], comm=[0, 0], microbatches=4)
    >>> simulate("1f1b", ranks=2, **args).step_time, shared_step("1f1b", ranks=2, cores=1, **args)
    (15.0, 24.0)
    """
    _, prog, ops = _compiled(schedule, forward, backward, comm, ranks, microbatches, weight_share)
    return run_shared(prog, *ops, cores=float(cores))


def _compiled(schedule: str, forward: Sequence[float], backward: Sequence[float], comm: Sequence[float], ranks: int,
              microbatches: int, weight_share: float) -> tuple[str, Program, tuple]:  # fmt: skip
    """The checked schedule name, its compiled op graph and the F, B (and zbv's W) seconds per chunk."""
    schedule, _, virtual = _check_costs(schedule, forward, backward, comm, ranks, microbatches, weight_share)
    prog = _program(schedule, ranks, virtual, microbatches)
    arrays = (np.asarray(x, dtype=np.float64) for x in (forward, backward, comm))
    return schedule, prog, durations(*arrays, split=zbv_split(weight_share, prog) if schedule == "zbv" else None)


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
    prog = _program(schedule, ranks, virtual, microbatches)
    split = zbv_split(weight_share, prog) if schedule == "zbv" else None
    rows = max(1, _BATCH // len(prog.ops))  # rows per pass: ops x rows floats stay in cache-sized blocks
    out = np.empty(n)
    for i in range(0, n, rows):
        cols = (x[i : i + rows].T for x in (fwd, bwd, com))
        end = run_fixed(prog, *durations(*cols, split=split), starts=False)[1]
        out[i : i + rows] = end[prog.last].max(axis=0)
    return out


_BATCH = 1 << 18  # op evaluations per numpy pass in step_times


def zbv_split(weight_share: float, prog: Program) -> np.ndarray:
    """W's share of each chunk's backward under zbv: ``weight_share``, but all of it for chunk 0.
    torch's ZBVZeroBubble skips the first stage's input pass (it has no input gradient to send) and
    runs its whole backward as the weight pass (``backward_one_chunk``: ``if not self.is_first``);
    measured in a GPT-2 zbv job: chunk 0's B 0.02 ms, its W the whole backward."""
    share = np.full(int(prog.chunk.max(initial=0)) + 1, float(weight_share))
    share[0] = 1.0
    return share


@lru_cache(maxsize=64)  # a cluster search asks ~30 shapes, each many times
def _program(schedule: str, ranks: int, virtual: int, m: int) -> Program:
    """The compiled op graph of a fixed-order schedule, once per process and shape."""
    return compile_orders(fixed_orders(schedule, ranks, virtual, m), ranks * virtual)


def _check_costs(schedule: str, forward: Sequence[float], backward: Sequence[float], comm: Sequence[float],
                 ranks: int, microbatches: int, weight_share: float) -> tuple[str, int, int]:  # fmt: skip
    k = len(forward)
    if len(backward) != k or len(comm) != k or k % ranks:
        raise PartitionError(f"simulate: need one forward/backward/comm value per chunk, a multiple of {ranks}.")
    virtual = k // ranks
    schedule = check_schedule(schedule, ranks, virtual, microbatches)
    check_weight_share(weight_share)
    return schedule, k, virtual


def inflight_counts(schedule: str, ranks: int, virtual: int, microbatches: int) -> list[int]:
    """Per chunk, the most micro-batches whose activations it may hold at once under ``schedule``.

    A unit is held from its F to its B (to its W when the backward is split). GPipe, 1F1B and
    interleaved run a fixed op order, so the count is read off that order and holds for any costs:
    M for GPipe, min(S - s, M) for 1F1B, and for zbv what torch's ZBVZeroBubble order holds from F
    to W (``zbv_order``).
    """
    return list(_inflight_counts(check_schedule(schedule, ranks, virtual, microbatches), ranks, virtual, microbatches))


@lru_cache(maxsize=1024)
def _inflight_counts(schedule: str, ranks: int, virtual: int, microbatches: int) -> tuple[int, ...]:
    """``inflight_counts`` once per shape: the cluster search asks it of every layout (thousands, a few
    hundred shapes), and reading a 64-stage order of 128 micro-batches costs milliseconds."""
    k = ranks * virtual
    peak = [0] * k
    for order in fixed_orders(schedule, ranks, virtual, microbatches):
        held = [0] * k
        split = any(kind == "W" for kind, _, _ in order)  # with W, a unit is held until its W
        for kind, _, c in order:
            if kind == "F":
                held[c] += 1
                peak[c] = max(peak[c], held[c])
            elif kind == "W" or not split:
                held[c] -= 1
    return tuple(peak)


def _walk(order: list[tuple[str, int, int]]):  # noqa: ANN202 (a generator of the two dicts)
    """After each op of a rank's ``order``: per chunk, the units held (between F and B, or W where
    the backward is split) and waiting (between B and W)."""
    held: dict[int, int] = {}
    waiting: dict[int, int] = {}
    split = any(kind == "W" for kind, _, _ in order)
    for kind, _, c in order:
        # torch never splits the first stage's backward (nothing upstream waits for its input
        # gradients): its B does nothing and its W is the whole backward, so its units stay held
        first = c == 0
        if kind == "F":
            held[c] = held.get(c, 0) + 1
        elif kind == "B" and not (split and first):
            held[c] -= 1
            waiting[c] = waiting.get(c, 0) + split
        elif kind == "W" and first:
            held[c] -= 1
        elif kind == "W":
            waiting[c] -= 1
        yield held, waiting


@lru_cache(maxsize=64)
def _peak_states(schedule: str, ranks: int, virtual: int, m: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    # each chunk's own states are its column of its rank's joint states (the (0, 0) a chunk shows
    # before its first op is under every hull)
    seen: list[set[tuple[int, int]]] = [set() for _ in range(ranks * virtual)]
    for chunks, states in _rank_states(schedule, ranks, virtual, m):
        for i, c in enumerate(chunks):
            seen[c].update(st[i] for st in states)
    return tuple(_upper_hull(states) for states in seen)


@lru_cache(maxsize=64)
def _rank_states(schedule: str, ranks: int, virtual: int, m: int) -> tuple[tuple[tuple[int, ...], tuple], ...]:
    out = []
    for order in fixed_orders(schedule, ranks, virtual, m):
        chunks = tuple(sorted({c for _, _, c in order}))
        seen = {tuple((held.get(c, 0), waiting.get(c, 0)) for c in chunks) for held, waiting in _walk(order)}
        out.append((chunks, tuple(sorted(seen))))
    return tuple(out)


def rank_states(schedule: str, ranks: int, virtual: int,
                microbatches: int) -> list[tuple[tuple[int, ...], tuple[tuple[tuple[int, int], ...], ...]]]:
    """Per rank, its chunks and the joint states its op order passes through: for each, the
    (held, waiting) of every chunk of the rank at once (``peak_states`` takes each chunk alone).
    A rank's chunks do not peak together: under interleaved 1F1B the first chunk's units are
    being freed while the last's are still arriving, so the rank's peak is the heaviest joint state,
    not the sum of its chunks' own peaks.

    >>> chunks, states = rank_states("interleaved1f1b", 2, 2, 4)[0]
    >>> chunks, [max(s[i][0] for s in states) for i in range(2)], max(a + b for (a, _), (b, _) in states)
    ((0, 2), [4, 2], 5)
    >>> [len(states) for _, states in rank_states("1f1b", 2, 1, 4)]  # one chunk: 0, 1, 2 held on rank 0
    [3, 2]

    Rank 0 holds 5 units at once at most, where its chunks' own peaks add up to 6.
    """
    schedule = check_schedule(schedule, ranks, virtual, microbatches)
    return list(_rank_states(schedule, ranks, virtual, microbatches))


def _upper_hull(states: set[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The states some ``x * held + y * waiting`` (x, y >= 0) is largest at: the vertices of the
    upper-right hull, from most held to most waiting."""
    pts = sorted(states, key=lambda p: (-p[0], -p[1]))
    front: list[tuple[int, int]] = []
    for p in pts:  # most held first; keep each that waits more than every one before it
        if not front or p[1] > front[-1][1]:
            front.append(p)
    hull: list[tuple[int, int]] = []
    for p in front:
        # drop the last vertex while it lies on or under the segment from the one before it to p
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (p[1] - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])) <= 0:  # fmt: skip
            hull.pop()
        hull.append(p)
    return tuple(hull)


def peak_states(schedule: str, ranks: int, virtual: int, microbatches: int) -> list[tuple[tuple[int, int], ...]]:
    """Per chunk, the (held, waiting) states along its rank's op order that can be its peak:
    ``held`` micro-batches are between their F and their B and keep the forward's saved activations
    (and, on the last chunk, the model's output), ``waiting`` ones are between their B and their W
    (zero-bubble only) and keep what the weight gradients need. A chunk holds
    ``held * (kept + output) + waiting * hold`` with ``kept``, ``output``, ``hold`` >= 0 that depend
    on its cut and recompute mode, so its peak is at one of these: the vertices of the upper hull
    of the states it passes through (one state without a split backward: ``inflight_counts``).

    Torch never splits the first stage (chunk 0): its units stay held until their W.

    >>> peak_states("zbv", 4, 2, 8)[3], peak_states("1f1b", 2, 1, 4)
    (((5, 0), (4, 1), (0, 4)), [((2, 0),), ((1, 0),)])
    """
    schedule = check_schedule(schedule, ranks, virtual, microbatches)
    return list(_peak_states(schedule, ranks, virtual, microbatches))


def zbv_order(ranks: int, microbatches: int, rank: int) -> list[tuple[str, int, int]]:
    """Rank ``rank``'s op order (kind F/B/W, micro-batch, chunk) under torch's ZBVZeroBubble.

    The V: rank r runs chunk r (shallow) and chunk 2S-1-r (deep). The order is fixed (ZB-V, Qi et
    al. 2024, section 6, as torch.distributed.pipelining lays it out for M >= 2S-1, with the
    micro-batches beyond M dropped): warm-up forwards on the shallow chunk, then deep forwards each
    followed at once by their backward and weight pass, a steady F-B-W on each chunk in turn, and a
    cool-down that runs the backwards first and the deferred weight passes last.
    """
    s, r = ranks, rank
    n = max(2 * s - 1, microbatches)
    lo, hi = r, 2 * s - 1 - r
    ops: list[tuple[str, int, int]] = []
    nf = {lo: 0, hi: 0}
    nb = {lo: 0, hi: 0}

    def run(kind: str, chunk: int, counter: dict[int, int]) -> None:
        ops.append((kind, counter[chunk], chunk))
        counter[chunk] += 1

    for _ in range(2 * (s - r) - 1):
        run("F", lo, nf)
    for _ in range(r):
        run("F", hi, nf)
        run("F", lo, nf)
    for _ in range(s - r):
        run("F", hi, nf)
        ops += [("B", nb[hi], hi), ("W", nb[hi], hi)]
        nb[hi] += 1
    while nf[hi] < nf[lo] or nf[lo] < n:
        if nf[lo] < n:
            run("F", lo, nf)
        ops += [("B", nb[lo], lo), ("W", nb[lo], lo)]
        nb[lo] += 1
        run("F", hi, nf)
        ops += [("B", nb[hi], hi), ("W", nb[hi], hi)]
        nb[hi] += 1
    nw = dict(nb)  # weight passes done so far = backwards done so far
    for _ in range(r):
        run("B", lo, nb)
        run("B", hi, nb)
    for _ in range(s - r):
        run("B", lo, nb)
        run("W", lo, nw)
    while nw[hi] < nb[hi]:
        run("W", hi, nw)
    while nw[lo] < nb[lo]:
        run("W", lo, nw)
    return [op for op in ops if op[1] < microbatches]
