"""Each engine's best plan side by side (``autopipe plan --compare``, ``--engine auto``)."""

from __future__ import annotations

from rich.table import Table

from ..planner.engine_choice import EngineChoice
from ..units import format_bytes

__all__ = ["engine_table"]


def engine_table(choice: EngineChoice) -> Table:
    """One row per engine: its schedule and cut, the schedule's step, what follows it, the whole step, memory; the
    engines that cannot run the options with why."""
    table = Table(title="engines: each one's best plan (measured overheads per engine)", title_justify="left")
    for col in ("engine", "schedule", "cut", "schedule ms", "after ms", "whole step ms", "vs best", "peak memory", "note"):
        table.add_column(col, justify="left" if col in ("engine", "schedule", "cut", "note") else "right")
    best = choice.plan.total_step_time
    for engine, p in choice.plans:
        ratio = p.total_step_time / best if best > 0 else 1.0
        table.add_row(engine, p.schedule, " ".join(map(str, p.boundaries)), f"{p.step_time * 1e3:.1f}", f"{p.step_overhead * 1e3:.1f}",
                      f"{p.total_step_time * 1e3:.1f}", f"{ratio:.3f}x", format_bytes(p.peak_memory),
                      "chosen" if engine == choice.engine else "")  # fmt: skip
    for engine, why in choice.skipped:
        table.add_row(engine, "-", "-", "-", "-", "-", "-", "-", why)
    return table
