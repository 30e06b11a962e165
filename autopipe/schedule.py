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

Example:
    >>> sim = simulate("gpipe", forward=[1, 1], backward=[2, 2], comm=[0, 0], ranks=2, microbatches=4)
    >>> sim.step_time  # (M + S - 1) * (f + b)
    15.0
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from .errors import PartitionError

__all__ = [
    "SCHEDULES",
    "Simulation",
    "normalize_schedule",
    "check_schedule",
    "check_weight_share",
    "chunk_ranks",
    "simulate",
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
    k = len(forward)
    if len(backward) != k or len(comm) != k or k % ranks:
        raise PartitionError(f"simulate: need one forward/backward/comm value per chunk, a multiple of {ranks}.")
    virtual = k // ranks
    schedule = check_schedule(schedule, ranks, virtual, microbatches)
    check_weight_share(weight_share)
    placement = chunk_ranks(schedule, ranks, virtual)
    zb = schedule == "zbv"
    dur = {
        "F": [forward[c] + comm[c] for c in range(k)],
        "B": [backward[c] * (1 - weight_share if zb else 1.0) + comm[c] for c in range(k)],
        "W": [backward[c] * weight_share for c in range(k)],
    }
    chooser = _ZBV(placement, ranks, microbatches) if zb else _Fixed(_fixed_orders(schedule, ranks, virtual, microbatches))
    end: dict[tuple[str, int, int], float] = {}
    timeline: list[list[TimelineEntry]] = [[] for _ in range(ranks)]
    free = [0.0] * ranks
    events: list[float] = []
    total = microbatches * k * (3 if zb else 2)
    done = 0
    while done < total:
        active = [r for r in range(ranks) if not chooser.finished(r)]
        now = min(free[r] for r in active)
        for r in active:
            if free[r] != now:
                continue
            op = chooser.choose(r, lambda key: key in end and end[key] <= now, k)
            if op is not None:
                kind, mb, c = op
                finish = now + dur[kind][c]
                end[op] = finish
                timeline[r].append((now, finish, kind, mb, c))
                heapq.heappush(events, finish)
                free[r] = finish
                done += 1
                break
        else:  # nobody free at `now` can start anything: wait for the next op to finish
            while events and events[0] <= now:
                heapq.heappop(events)
            later = [free[r] for r in active if free[r] > now] + events[:1]
            if not later:
                raise RuntimeError(f"schedule {schedule} deadlocked at t={now}")  # a bug, not user input
            for r in active:
                if free[r] == now:
                    free[r] = min(later)
    step = max((tl[-1][1] for tl in timeline if tl), default=0.0)
    busy = tuple(sum(e - s for s, e, *_ in tl) for tl in timeline)
    bubble = 1.0 - sum(busy) / (ranks * step) if step > 0 else 0.0
    return Simulation(schedule, ranks, microbatches, step, bubble, busy, tuple(tuple(tl) for tl in timeline))


def _deps(kind: str, mb: int, c: int, chunks: int) -> list[tuple[str, int, int]]:
    """What an op waits for: the previous chunk's F, the next chunk's B and its own F, its own B."""
    if kind == "F":
        return [("F", mb, c - 1)] if c > 0 else []
    if kind == "B":
        return [("F", mb, c)] + ([("B", mb, c + 1)] if c < chunks - 1 else [])
    return [("B", mb, c)]


class _Fixed:
    """Each rank runs its given order; an op waits until its inputs are done."""

    def __init__(self, orders: list[list[tuple[str, int, int]]]) -> None:
        self.orders = orders
        self.pos = [0] * len(orders)

    def finished(self, r: int) -> bool:
        return self.pos[r] >= len(self.orders[r])

    def choose(self, r: int, ready, chunks: int):
        op = self.orders[r][self.pos[r]]
        if all(ready(d) for d in _deps(*op, chunks)):
            self.pos[r] += 1
            return op
        return None


class _ZBV:
    """Greedy zero-bubble rank: ready B first, then a ready F under the in-flight cap, then a W."""

    def __init__(self, placement: Sequence[int], ranks: int, m: int) -> None:
        self.m = m
        # Micro-batches the shallow chunk may hold (F done, W not yet). Only the shallow chunk is
        # capped: the deep one must always be free to move, or a full rank would wait on itself.
        self.cap = _zbv_cap(ranks)
        self.chunks = [[c for c, r in enumerate(placement) if r == rank] for rank in range(ranks)]
        self.next_f = {c: 0 for c in range(len(placement))}
        self.next_b = dict(self.next_f)
        self.pending_w: list[list[tuple[str, int, int]]] = [[] for _ in range(ranks)]
        self.inflight = [0] * ranks
        self.left = [3 * m * len(cs) for cs in self.chunks]

    def finished(self, r: int) -> bool:
        return self.left[r] == 0

    def choose(self, r: int, ready, chunks: int):
        mine = sorted(self.chunks[r], reverse=True)  # the deeper chunk first: it frees memory sooner
        for c in mine:
            i = self.next_b[c]
            if i < self.m and all(ready(d) for d in _deps("B", i, c, chunks)):
                self.next_b[c] += 1
                self.pending_w[r].append(("W", i, c))
                return self._take(r, ("B", i, c))
        shallow = min(mine)
        for c in mine:
            i = self.next_f[c]
            if c == shallow and self.inflight[r] >= self.cap:
                continue
            if i < self.m and all(ready(d) for d in _deps("F", i, c, chunks)):
                self.next_f[c] += 1
                self.inflight[r] += c == shallow
                return self._take(r, ("F", i, c))
        if self.pending_w[r]:
            op = self.pending_w[r].pop(0)
            self.inflight[r] -= op[2] == shallow  # W frees the last activations of that unit
            return self._take(r, op)
        return None

    def _take(self, r: int, op: tuple[str, int, int]) -> tuple[str, int, int]:
        self.left[r] -= 1
        return op


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
