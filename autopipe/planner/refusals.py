"""Why no cut fits, in one line that says what would: the layer too big on its own, recompute,
more stages, ZeRO, more memory. No torch."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from ..choices import ZERO_STAGES
from ..errors import InfeasibleMemoryError, PartitionError
from ..units import format_bytes
from .chunk_costs import ChunkCosts
from .cost_model import CostModel, CutRequest, unit_states
from .plan import Plan
from .schedules import check_schedule
from .step_bound import fits, least_memory

__all__ = ["device_limit", "explain_infeasible", "chunk_need", "fits_sentence", "held_beside", "limit_text",
           "recompute_hint", "with_zero_hint"]


def explain_infeasible(model: CostModel, req: CutRequest, chunk_limit: int | None, what: str) -> InfeasibleMemoryError:
    """Why nothing fits: the layer too big on its own, else what would fit (recompute, stages, ZeRO, memory)."""
    stages, v, m, schedule, limit, recompute = req.stages, req.v, req.m, req.schedule, req.limit, req.recompute
    assert limit is not None and chunk_limit is not None
    states = req.states
    fewest = min(u for st in states for u, _ in st)
    c, n = model.costs, model.costs.n
    allowed = model.allowed(recompute)
    everything = tuple(range(len(c.modes)))
    idx = np.arange(n)
    alone = np.min([c.memory(idx, idx + 1, u, md, w) for md in everything for st in states for u, w in st], axis=0)
    where = f"{stages} stages ({schedule}, {m} micro-batches{f', {v} virtual' if v > 1 else ''})"
    head = f"no cut into {where} fits {what}"
    worst = int(np.argmax(alone))
    need = least_memory(c, stages * v, modes=allowed, states=states) * v
    fits_text = fits_sentence(model, req)
    if alone[worst] > chunk_limit:
        # name a limit that fits the stages asked for, not only the layer's own bound (a user who
        # tried that bound was refused again)
        return InfeasibleMemoryError(
            f"{head}: layer {worst} ({model.names[worst]}) alone needs {format_bytes(int(alone[worst]))} "
            f"(parameters, gradients, optimizer state and {fewest} micro-batch of activations, recomputed "
            f"or not), so no number of stages fits; {fits_text}. Raise --memory-limit or use a lighter optimizer."
        )
    hints = []
    if set(allowed) != set(everything) and fits(c, stages * v, limit=chunk_limit, modes=everything, states=states):
        hints.append("recompute auto (--recompute auto) would fit")
    more = None
    tried = min(n // v, 8 * stages)  # each try is a feasibility test: stay within a second or so
    for s in range(stages + 1, tried + 1):
        try:
            sched_ok = check_schedule(schedule, s, v, m)
        except PartitionError:
            continue  # e.g. interleaved needs M to be a multiple of the stages
        if fits(c, s * v, limit=chunk_limit, modes=allowed, states=unit_states(sched_ok, s, v, m)):
            more = s
            break
    hints.append(f"{more} stages would fit" if more else f"no number of stages up to {tried} fits")
    # ZeRO-1 shards optimizer state over data-parallel replicas: say how much of a rank it is.
    state = sum(model.memory.optimizer) / stages
    if state > 0.1 * need and model.zero == 0:
        replicas = "the replicas" if model.dp > 1 else "data-parallel replicas (--dp N)"
        hints.append(f"optimizer state is ~{format_bytes(int(state))} per rank (ZeRO-1 across {replicas} shards it)")
    fixes = ["add stages", "raise --memory-limit"]
    if recompute != "auto":
        fixes.append("use --recompute auto")
    if schedule == "gpipe":
        fixes.append("use 1f1b (it holds fewer micro-batches than gpipe)")
    return InfeasibleMemoryError(
        f"{head}: {'; '.join(hints)}; {fits_text}. {', '.join(fixes[:-1]).capitalize()} or {fixes[-1]}."
    )


def fits_sentence(model: CostModel, req: CutRequest) -> str:
    """``--memory-limit X fits S stages (what X is made of)``: the least limit under which a cut of
    ``req``'s stages fits, as a person types it, with what a rank holds beside its tensors."""
    v = req.v
    need = least_memory(model.costs, req.stages * v, modes=model.allowed(req.recompute), states=req.states) * v
    return (f"--memory-limit {limit_text(device_limit(model, need // v, v))} fits {req.stages} stages "
            f"({format_bytes(need)} of tensors per device, and {held_beside(model)[1]})")


def device_limit(model: CostModel, chunk_bytes: int, v: int) -> int:
    """The smallest ``--memory-limit`` under which each of a rank's ``v`` chunks may hold
    ``chunk_bytes``: the partitioner gives each chunk ``(limit - reserve) // v``, the runtime's
    reserve (what a rank holds beyond its tensors: never below it) coming first; on a CPU what a
    rank was measured holding beyond its tensors where it is more (``cost_model.limit_reserve``)."""
    return chunk_bytes * v + held_beside(model)[0]


def held_beside(model: CostModel) -> tuple[int, str]:
    """Bytes a suggested limit leaves a rank beyond its tensors, and the words for them.

    The reserve is the probe's ranks' mean (autopipe.runtime.checks.reserve), so on a CPU one rank
    holds more: a 6-layer MLP's plan of 0.2 MiB a rank, suggested 1.11 MiB, ran at 2-7 MiB (issue 41).
    A CPU profile carries the most a probe rank held beyond its prediction (``rank_excess_bytes``);
    without it (a reserve given, an older profile) the advice says what it cannot promise. On a CPU a
    rank's resident memory under the job's default allocator also keeps its heap's free blocks,
    which no plan predicts (``train.py --exact-memory`` measures without them): said too.
    """
    if model.rank_excess is None:
        return model.reserve, f"the {format_bytes(model.reserve)} the runtime holds beside them"
    heap = ("; as train.py --exact-memory measures a CPU rank: by default its heap also keeps freed blocks, "
            "which no plan predicts")
    if model.rank_excess > 0:
        held = model.limit_reserve  # the partitioner leaves a rank as much (CostModel.budget)
        return held, f"the {format_bytes(held)} a CPU rank was measured holding beyond its tensors here{heap}"
    return model.reserve, (f"the {format_bytes(model.reserve)} reserve; what a CPU rank holds beyond that was not "
                           "measured for this profile (--reserve given, or an older profile), so a run may hold more: "
                           f"its resident memory is not predicted beyond the tensors and reserve{heap}")


def limit_text(n: int) -> str:
    """``n`` bytes as a ``--memory-limit`` a person can type, rounded up (never below ``n``).

    >>> limit_text(38_514_000), limit_text(3 * 2**30)
    ('36.73MiB', '3.00GiB')
    """
    from math import ceil

    from ..units import parse_size

    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        scale = 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(unit)
        if n < 1024 * scale or unit == "TiB":
            if unit == "B":
                return f"{n}B"
            text = f"{ceil(n / scale * 100) / 100:.2f}{unit}"
            assert parse_size(text) >= n, text
            return text
    raise AssertionError("unreachable")


def chunk_need(c: ChunkCosts, a: int, b: int, states: Sequence[tuple[int, int]], mode: int) -> int:
    """Bytes chunk [a, b) needs under ``mode``: its heaviest state."""
    return max(int(c.memory(a, b, u, mode, w)) for u, w in states)


def recompute_hint(model: CostModel, recompute: str, chunks: list[tuple[int, int, tuple[tuple[int, int], ...]]],
                    chunk_limit: int) -> str:  # fmt: skip
    """', or use recompute='auto'' when some mode the policy excludes would make these chunks fit
    (each chunk: start, end, the (units, waiting) states that can be its peak)."""
    c = model.costs
    others = [md for md in range(len(c.modes)) if md not in model.allowed(recompute)]
    if all(any(chunk_need(c, a, b, st, md) <= chunk_limit for md in others) for a, b, st in chunks) and others:
        return ", or use recompute auto (--recompute auto: it fits with recompute)"
    return ""


def with_zero_hint(err: InfeasibleMemoryError, attempt: Callable[[int], Plan], zeros: list[int],
                   dp: int) -> InfeasibleMemoryError:
    """A refusal at a fixed ZeRO stage, plus "ZeRO K would fit" when a higher stage does."""
    if dp == 1 or len(zeros) > 1:
        return err
    for z in range(zeros[0] + 1, ZERO_STAGES[-1] + 1):
        try:
            attempt(z)
        except InfeasibleMemoryError:
            continue
        return InfeasibleMemoryError(f"{str(err).rstrip('.')}; or shard more: ZeRO {z} over the {dp} replicas fits (--zero {z}).")
    return err
