"""Per-step logs: one rich line on rank 0, and JSON lines for machines (``--log-json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["StepLogger"]


class StepLogger:
    """Prints each step on rank 0 and appends it to a JSON-lines file.

    Each JSON line is ``StepStats.to_dict()`` plus whatever ``extra`` the caller adds.
    """

    def __init__(self, rank: int, *, json_path: str | os.PathLike[str] | None = None, quiet: bool = False) -> None:
        self.rank = rank
        self.quiet = quiet
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
        if self.console is not None:
            stages = " ".join(f"{t * 1000:.0f}" for t in stats.stage_times)
            skipped = " [yellow]skipped (fp16 overflow)[/]" if stats.skipped else ""
            self.console.print(
                f"step [bold]{stats.step:>5}[/]  loss [cyan]{stats.loss:.4f}[/]  lr {stats.lr:.2e}  "
                f"|g| {stats.grad_norm:.3f}  {stats.tokens_per_s:,.0f} tok/s  "
                f"{stats.step_time * 1000:.0f} ms  stages(ms) {stages}{skipped}"
            )
        if self.json_path is not None:
            record = {**stats.to_dict(), **extra}
            with open(self.json_path, "a") as f:
                f.write(json.dumps(record) + "\n")
