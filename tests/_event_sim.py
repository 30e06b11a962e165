"""The event-loop schedule simulator as it was before the fast path: the reference the tests compare with.

Kept verbatim (renamed to ``simulate_events``) so tests/test_schedule.py can check that
autopipe.planner.schedules.simulate gives identical results, timelines included. Not used by autopipe itself.
One change since: zbv runs torch's fixed ZB-V order (``fixed_orders``) like the other schedules,
where it ran a greedy order of its own; each op still waits for its inputs (``_deps``: a W for its B).
"""

from __future__ import annotations

import heapq
from typing import Sequence

from autopipe.errors import PartitionError
from autopipe.planner.schedules import (
    Simulation,
    TimelineEntry,
    check_schedule,
    check_weight_share,
    fixed_orders,
)


def simulate_events(
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
    zb = schedule == "zbv"
    share = [1.0 if c == 0 else weight_share for c in range(k)]  # torch never splits the first stage
    dur = {
        "F": [forward[c] + comm[c] for c in range(k)],
        "B": [backward[c] * (1 - share[c] if zb else 1.0) + comm[c] for c in range(k)],
        "W": [backward[c] * share[c] for c in range(k)],
    }
    chooser = _Fixed(fixed_orders(schedule, ranks, virtual, microbatches))
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
