"""Rich tables for plans: one plan's stages, and several partitioners side by side."""

from __future__ import annotations

from typing import Sequence

from rich.table import Table

from .plan import Plan
from .units import format_bytes

__all__ = ["plan_table", "compare_table", "plan_summary"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def plan_table(plan: Plan, title: str = "") -> Table:
    """One row per chunk: rank, layers, times (ms per micro-batch), memory, in-flight micro-batches."""
    table = Table(title=title or f"{plan.method}: {plan.num_layers} layers into {plan.num_chunks} chunks")
    recompute = any(mode != "none" for mode in plan.stage_recompute)  # a column only when some chunk recomputes
    cols = ("chunk", "rank", "layers", "first layer", "time ms", "fwd ms", "bwd ms", "comm ms", "memory", "in flight")
    for col in cols + (("recompute",) if recompute else ()):
        table.add_column(col, justify="left" if col in ("layers", "first layer", "recompute") else "right")
    for c in range(plan.num_chunks):
        a, b = plan.boundaries[c], plan.boundaries[c + 1]
        slow = c == plan.bottleneck_stage
        table.add_row(
            f"{c}{' *' if slow else ''}",
            str(plan.stage_ranks[c]),
            f"{a}..{b - 1} ({b - a})",
            plan.stage_first_layers[c] if plan.stage_first_layers else "",
            _ms(plan.stage_times[c]),
            _ms(plan.stage_forward[c]),
            _ms(plan.stage_backward[c]),
            _ms(2 * plan.stage_comm[c]),
            format_bytes(plan.stage_memory[c]),
            plan.inflight_text(c),
            *((plan.recompute_of(c),) if recompute else ()),
            style="bold" if slow else None,
        )
    return table


def limit_phrase(plan: Plan) -> str:
    """' of 80.00 GiB (the device's memory)' — the limit the plan was held to, and whence; '' for none."""
    if plan.memory_limit is None:
        return ""
    whence = " (the device's memory)" if plan.memory_limit_source == "device" else ""
    return f" of {format_bytes(plan.memory_limit)}{whence}"


def recompute_phrase(plan: Plan) -> str:
    """'; recompute: full on chunks 0, 1 (+2.1 ms per micro-batch at most)' — '' when no chunk recomputes."""
    chosen = [(c, mode) for c, mode in enumerate(plan.stage_recompute) if mode != "none"]
    if not chosen:
        return ""
    by_mode: dict[str, list[int]] = {}
    for c, mode in chosen:
        by_mode.setdefault(mode, []).append(c)
    what = "; ".join(f"{mode} on chunk{'s' if len(cs) > 1 else ''} {', '.join(map(str, cs))}" for mode, cs in by_mode.items())
    cost = max(plan.stage_recompute_time, default=0.0)
    return f"; recompute: {what} (+{_ms(cost)} ms per micro-batch at most)"


def sharding_phrase(plan: Plan) -> str:
    """'; per rank with 2 replicas, ZeRO 1 (chosen)' — '' for one replica."""
    if plan.dp <= 1:
        return ""
    chosen = " (chosen)" if plan.zero_policy == "auto" else ""
    return f"; per rank with {plan.dp} data-parallel replicas, ZeRO {plan.zero}{chosen}"


def plan_summary(plan: Plan) -> str:
    """One line: bottleneck, balance, step and bubble, autopipe's step when this is a baseline, and the bound."""
    line = (
        f"bottleneck chunk {plan.bottleneck_stage}: {_ms(plan.bottleneck_time)} ms/micro-batch, "
        f"balance (max/mean) {plan.balance:.3f}, peak memory {format_bytes(plan.peak_memory)}{limit_phrase(plan)}"
        f"{sharding_phrase(plan)}{recompute_phrase(plan)}, "
        f"{plan.schedule} step with {plan.microbatches} micro-batches {_ms(plan.step_time)} ms "
        f"(bubble {plan.bubble_fraction:.1%})"
    )
    if plan.optimum_step_time is not None:
        line += f"; autopipe's step {_ms(plan.optimum_step_time)} ms"
    if plan.step_lower_bound is not None:
        gap = plan.step_gap or 0.0
        line += f"; step lower bound {_ms(plan.step_lower_bound)} ms, " + ("optimal" if gap == 0 else f"gap {gap:.2%}")
    return line


def compare_table(plans: Sequence[Plan]) -> Table:
    """Partitioners side by side on the same profile; the first plan is the reference (autopipe)."""
    best = plans[0]
    table = Table(title=f"{best.num_layers} layers, {best.num_chunks} chunks, {best.schedule}, {best.microbatches} micro-batches")
    for col in ("method", "step ms", "vs autopipe", "bottleneck ms", "max/mean", "peak memory", "memory per stage", "fits"):
        table.add_column(col, justify="left" if col in ("method", "memory per stage") else "right")
    for p in plans:
        ratio = p.step_time / best.step_time if best.step_time > 0 else 1.0  # the objective: the step
        fits = "-" if p.memory_limit is None else ("yes" if p.peak_memory <= p.memory_limit else "NO")
        table.add_row(
            p.method,
            _ms(p.step_time),
            f"{ratio:.3f}x",
            _ms(p.bottleneck_time),
            f"{p.balance:.3f}",
            format_bytes(p.peak_memory),
            " ".join(format_bytes(m).replace(" ", "") for m in p.rank_memory),
            fits,
        )
    return table
