"""Per-step logs: one rich line on rank 0, and JSON lines for machines (``--log-json``).

When the run is the one its plan was made for (same schedule, micro-batches, batch size), the plan's
predictions are logged beside the measurements: the simulated step time against the measured one,
and each pipeline rank's predicted peak memory against its measured peak (see
:mod:`autopipe.runtime.peak`), so a person sees at once how far the plan is off.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Predictions", "StepLogger", "predictions"]


@dataclass(frozen=True)
class Predictions:
    """What the plan promised for this run."""

    step_time: float  # seconds, simulated
    rank_memory: tuple[int, ...]  # bytes per pipeline rank


def predictions(plan: Any, *, schedule: str, microbatches: int, pp_size: int, dp: int = 1,
                zero: int = 0) -> Predictions | None:
    """The plan's step time and per-rank memory, or None when the run differs from what was planned
    (another schedule, micro-batch count, stage count, replica count or ZeRO stage, or a plan
    without predictions)."""
    from .layout import schedule_name

    if plan is None or not hasattr(plan, "rank_memory") or not hasattr(plan, "step_time"):
        return None
    try:
        same = (
            schedule_name(plan.schedule) == schedule_name(schedule)
            and plan.microbatches == microbatches
            and plan.stages == pp_size
            and int(getattr(plan, "dp", 1)) == dp
            and (dp == 1 or int(getattr(plan, "zero", 0)) == zero)  # one replica shards nothing
        )
    except Exception:  # an unknown schedule name in a hand-edited plan: nothing to compare
        return None
    return Predictions(float(plan.step_time), tuple(int(m) for m in plan.rank_memory)) if same else None


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


class StepLogger:
    """Prints each step on rank 0 and appends it to a JSON-lines file.

    Each JSON line is ``StepStats.to_dict()`` plus the plan's predictions (``predicted_step_time``,
    ``predicted_peak_memory``) when given, plus whatever ``extra`` the caller adds.
    """

    def __init__(
        self,
        rank: int,
        *,
        json_path: str | os.PathLike[str] | None = None,
        quiet: bool = False,
        predicted: Predictions | None = None,
        unit: str = "tok",
    ) -> None:
        self.rank = rank
        self.unit = unit  # what the throughput counts: "tok" for token inputs, "samples" otherwise
        self.quiet = quiet
        self.predicted = predicted
        self.json_path = Path(json_path) if json_path else None
        self.console = None
        if rank == 0 and not quiet:
            from rich.console import Console

            self.console = Console(highlight=False, soft_wrap=True)
        if rank == 0 and self.json_path is not None:
            self.json_path.parent.mkdir(parents=True, exist_ok=True)

    def info(self, message: str) -> None:
        if self.console is not None:
            self.console.print(message)

    def step(self, stats: Any, **extra: Any) -> None:
        if self.rank != 0:
            return
        pred = self.predicted
        if self.console is not None:
            stages = " ".join(f"{t * 1000:.0f}" for t in stats.stage_times)
            skipped = " [yellow]skipped (fp16 overflow)[/]" if stats.skipped else ""
            step = f"{stats.step_time * 1000:.0f} ms"
            if pred is not None and pred.step_time > 0:
                step += f" (plan {pred.step_time * 1000:.0f})"
            memory = ""
            if getattr(stats, "peak_memory", None) and any(stats.peak_memory):
                memory = "  mem(MiB) " + " ".join(_mib(m) for m in stats.peak_memory)
                if pred is not None and getattr(stats, "memory_exact", True):  # else not what the plan counts
                    memory += " (plan " + " ".join(_mib(m) for m in pred.rank_memory) + ")"
            self.console.print(
                f"step [bold]{stats.step:>5}[/]  loss [cyan]{stats.loss:.4f}[/]  lr {stats.lr:.2e}  "
                f"|g| {stats.grad_norm:.3f}  {stats.tokens_per_s:,.0f} {self.unit}/s  "
                f"{step}  stages(ms) {stages}{memory}{skipped}"
            )
        if self.json_path is not None:
            record = {**stats.to_dict(), **extra}
            if pred is not None:
                record["predicted_step_time"] = pred.step_time
                record["predicted_peak_memory"] = list(pred.rank_memory)
            with open(self.json_path, "a") as f:
                f.write(json.dumps(record) + "\n")
