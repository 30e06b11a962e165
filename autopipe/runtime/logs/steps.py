"""Per-step logs: the progress line on rank 0, and the same record for JSON lines, TensorBoard, W&B.

Each step, rank 0 prints one line: step of steps, loss, learning rate, gradient norm, tokens (or
samples) per second, step time, the time left (``ETA``, from the recent steps' wall-clock pace,
evaluation and checkpoints included: the last 50 steps), and the model FLOPs utilisation (``MFU``: the model's
forward-and-backward FLOPs per step over the devices' peak, on GPUs whose peak is known; elsewhere
the model FLOP/s), then the stages' times and each pipeline rank's peak memory. On a terminal the
line is live: redrawn in place every step, kept every ``log_every`` steps (default 10; 1 when the
output is a file, so a log keeps every step).

When the run is the one its plan was made for (same schedule, micro-batches, batch size), the plan's
predictions are logged beside the measurements: its whole step (``Plan.predicted_step``, the figure
convert printed) against the measured whole step, and each pipeline rank's predicted peak memory
against its measured peak (see :mod:`autopipe.runtime.logs.peak`), so a person sees at once how far
the plan is off; where the profile behind the plan was noisy, the line says so beside the figure.

The record behind the line goes to every sink asked for (``autopipe.runtime.logs.sinks``): ``--log-json``,
``--tensorboard``, ``--wandb``.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ...errors import AutopipeError
from ...units import format_time
from ...planner.stage_plan import StagePlan

__all__ = ["Predictions", "StepLogger", "StepStats", "format_eta", "predictions"]


@dataclass(frozen=True)
class Predictions:
    """What the plan promised for this run."""

    step_time: float  # seconds: the whole step, as Plan.predicted_step
    rank_memory: tuple[int, ...]  # bytes per pipeline rank
    noise: str = ""  # what made the profile behind step_time doubtful (Plan.profile_noise); "": nothing


def predictions(plan: StagePlan | int | None, *, schedule: str, microbatches: int, pp_size: int, dp: int = 1,
                zero: int = 0, tp: int = 1) -> Predictions | None:
    """The plan's step time and per-rank memory, or None when the run differs from what was planned
    (another schedule, micro-batch count, stage count, replica count, tp degree or ZeRO stage, or a plan
    without predictions: a hand-written cut, or a chunk count)."""
    if not isinstance(plan, StagePlan):
        return None
    if tp != getattr(plan, "tp", 1):  # planned for another tensor-parallel degree: its figures are another run's
        return None
    try:
        same = plan.predicts(schedule=schedule, microbatches=microbatches, pp_size=pp_size, dp=dp, zero=zero)
    except AutopipeError:  # an unknown schedule name: nothing to compare
        return None
    if not same or plan.step_time is None:
        return None
    return Predictions(float(plan.step_time), plan.rank_memory, plan.step_noise)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def format_eta(seconds: float) -> str:
    """``2h05m``, ``3m12s``, ``45s``.

    >>> format_eta(7500), format_eta(192.4), format_eta(45)
    ('2h05m', '3m12s', '45s')
    """
    s = max(0, int(round(seconds)))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _flops(rate: float) -> str:
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate / 1e6:.3g} MFLOP/s"


class StepLogger:
    """Prints each step on rank 0 and hands its record to the sinks (see the module docstring).

    Each record is ``StepStats.to_dict()`` plus the plan's predictions (``predicted_step_time``,
    ``predicted_peak_memory``, and ``predicted_step_noise`` after a noisy profile) when given, the progress figures (``eta_s``; ``model_flops_per_s``
    and ``mfu`` when the FLOPs are known), plus whatever ``extra`` the caller adds (``epoch``,
    ``eval_loss`` ...).

    Args:
        steps: the run's last step (for ``step 5/100`` and the ETA).
        flops_per_step: the model's forward-and-backward FLOPs for one whole step (all replicas).
        peak_flops: the whole world's peak FLOP/s (devices x each one's), for the MFU.
        tensorboard, wandb: a TensorBoard folder, a W&B project (None: not written).
        run_config: what the run was started with (W&B's config).
        log_every: print a kept line every N steps (None: 10 on a terminal, else 1).
        console: a rich Console to print on (tests give one writing to a buffer).
    """

    def __init__(
        self,
        rank: int,
        *,
        json_path: str | os.PathLike[str] | None = None,
        quiet: bool = False,
        predicted: Predictions | None = None,
        unit: str = "tok",
        steps: int | None = None,
        flops_per_step: float | None = None,
        peak_flops: float | None = None,
        tensorboard: str | os.PathLike[str] | None = None,
        wandb: str | None = None,
        run_config: dict[str, Any] | None = None,
        log_every: int | None = None,
        console: Any = None,
    ) -> None:
        self.rank = rank
        self.unit = unit  # what the throughput counts: "tok" for token inputs, "samples" otherwise
        self.quiet = quiet
        self.predicted = predicted
        self.steps = steps
        self.flops_per_step = flops_per_step or None
        self.peak_flops = peak_flops or None
        self.json_path = Path(json_path) if json_path else None
        self.console = None
        self._tensorboard = tensorboard
        self._wandb = wandb
        self._run_config = run_config
        self._sinks: list[Any] | None = None
        self._resumed: int | None = None
        self._live: Any = None
        self._intervals: deque[float] = deque(maxlen=50)  # seconds between the last steps
        self._noted = False  # the noisy profile's note is said once, before the first step's line
        self._last: float | None = None
        if rank == 0 and not quiet:
            if console is None:
                from rich.console import Console

                console = Console(highlight=False, soft_wrap=True, emoji=False)
            self.console = console
        terminal = bool(self.console is not None and self.console.is_terminal)
        self.log_every = max(1, int(log_every)) if log_every else (10 if terminal else 1)
        self.live = terminal and self.log_every > 1

    # ---- the sinks: made on first use, so that a resume can purge what it trains again ----------
    def _open(self) -> list[Any]:
        if self._sinks is None:
            from .sinks import JsonLines, TensorBoard, WandB

            self._sinks = []
            if self.rank == 0:
                if self.json_path is not None:
                    self._sinks.append(JsonLines(self.json_path))
                if self._tensorboard is not None:
                    self._sinks.append(TensorBoard(self._tensorboard, resume_step=self._resumed))
                if self._wandb is not None:
                    self._sinks.append(WandB(self._wandb, config=self._run_config))
                if self._resumed is not None and self.json_path is not None:
                    self._sinks[0].resumed(self._resumed)
        return self._sinks

    def resumed(self, step: int) -> None:
        """This run continues from a checkpoint of ``step``: records of later steps, which a stopped
        run logged after its last checkpoint, are dropped (``--log-json``) or purged (TensorBoard)."""
        self._resumed = int(step)
        if self._sinks is not None:
            for sink in self._sinks:
                sink.resumed(self._resumed)

    def open(self) -> None:
        """Open the sinks now (a missing package is said before training, not at the first step)."""
        self._open()

    def info(self, message: str) -> None:
        if self.console is not None:
            # verbatim: a message names the user's model and files, where rich would read ":llama:" as
            # an emoji code and "[x]" as markup (a factory tests/tp_models.py:llama printed as a llama)
            self.console.print(message, markup=False, emoji=False, highlight=False)

    def step(self, stats: Any, **extra: Any) -> None:
        if self.rank != 0:
            return
        now = time.perf_counter()
        if self._last is not None:  # the wall clock between steps: evaluations and checkpoints included
            self._intervals.append(now - self._last)
        self._last = now
        # the recent pace (the first step, which also sets the pipeline up, only until there is one)
        pace = sum(self._intervals) / len(self._intervals) if self._intervals else stats.step_time
        record = {**stats.to_dict(), **extra}
        pred = self.predicted
        if pred is not None:
            record["predicted_step_time"] = pred.step_time
            record["predicted_peak_memory"] = list(pred.rank_memory)
            if pred.noise:
                record["predicted_step_noise"] = pred.noise
        if self.steps is not None:
            record["eta_s"] = max(0, self.steps - stats.step) * pace
        if self.flops_per_step and stats.step_time > 0:
            record["model_flops_per_s"] = self.flops_per_step / stats.step_time
            if self.peak_flops:
                record["mfu"] = record["model_flops_per_s"] / self.peak_flops
        for sink in self._open():
            sink.write(record)
        if self.console is None:
            return
        if pred is not None and pred.noise and not self._noted:
            self._noted = True
            self._print(f"[yellow]note:[/] the plan's step ({format_time(pred.step_time)}) comes from a noisy profile "
                        f"({pred.noise}); profile again on a quiet machine for a firmer figure.")
        line = self._line(stats, record)
        last = self.steps is not None and stats.step >= self.steps
        if stats.step % self.log_every == 0 or last or "eval_loss" in record or not self.live:
            self._print(line)
        else:
            self._show(line)

    def eval(self, step: int, figures: dict[str, float]) -> None:
        """An evaluation that no training step goes with (before the first step, or at the end)."""
        if self.rank != 0:
            return
        record = {"step": int(step), **figures}
        for sink in self._open():
            sink.write(record)
        if self.console is not None:
            self._print(f"step [bold]{step:>5}[/]  {_eval_text(record)}")

    def close(self) -> None:
        """Stop the live line and flush the sinks (TensorBoard's events, W&B's run)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        for sink in self._sinks or []:
            sink.close()
        self._sinks = []

    # ---- the terminal ---------------------------------------------------------------------------
    def _print(self, line: str) -> None:
        if self._live is not None:  # the live line makes way (transient: it leaves nothing behind)
            self._live.stop()
            self._live = None
        self.console.print(line)  # type: ignore[union-attr]

    def _show(self, line: str) -> None:
        from rich.live import Live
        from rich.text import Text

        text = Text.from_markup(line)
        if self._live is None:
            self._live = Live(text, console=self.console, transient=True, auto_refresh=False)
            self._live.start()
        self._live.update(text, refresh=True)

    def _line(self, stats: Any, record: dict[str, Any]) -> str:
        pred = self.predicted
        stages = " ".join(f"{t * 1000:.0f}" for t in stats.stage_times)
        skipped = " [yellow]skipped (fp16 overflow)[/]" if stats.skipped else ""
        step = f"{stats.whole_step * 1000:.0f} ms"
        if pred is not None and pred.step_time > 0:
            # the plan's figure as convert, the README and the report print it (units.format_time)
            step += f" (plan {format_time(pred.step_time)}{', noisy profile' if pred.noise else ''})"
        memory = ""
        if getattr(stats, "peak_memory", None) and any(stats.peak_memory):
            memory = "  mem(MiB) " + " ".join(_mib(m) for m in stats.peak_memory)
            if pred is not None and getattr(stats, "memory_exact", True):  # else not what the plan counts
                memory += " (plan " + " ".join(_mib(m) for m in pred.rank_memory) + ")"
        of = f"/{self.steps}" if self.steps is not None else ""
        progress = ""
        if "epoch" in record:
            progress += f"  epoch {record['epoch']:.2f}"
        if "eta_s" in record and stats.step < (self.steps or 0):
            progress += f"  ETA {format_eta(record['eta_s'])}"
        if "mfu" in record:
            progress += f"  MFU {record['mfu']:.1%}"
        elif "model_flops_per_s" in record:
            progress += f"  {_flops(record['model_flops_per_s'])}"
        evaluated = f"  {_eval_text(record)}" if "eval_loss" in record else ""
        return (
            f"step [bold]{stats.step:>5}[/]{of}  loss [cyan]{stats.loss:.4f}[/]  lr {stats.lr:.2e}  "
            f"|g| {stats.grad_norm:.3f}  {stats.tokens_per_s:,.0f} {self.unit}/s  {step}{progress}{evaluated}  "
            f"stages(ms) {stages}{memory}{skipped}"
        )


def _eval_text(record: dict[str, Any]) -> str:
    text = f"eval loss [magenta]{record['eval_loss']:.4f}[/]"
    if record.get("eval_perplexity") is not None and math.isfinite(record["eval_perplexity"]):
        text += f" ppl {record['eval_perplexity']:.2f}"
    if record.get("eval_accuracy") is not None:
        text += f" acc {record['eval_accuracy']:.1%}"
    return text


@dataclass(frozen=True)
class StepStats:
    """What one step did, the same on every rank (rank 0 prints it)."""

    step: int  # 1-based: the number of optimizer steps done after this one
    loss: float  # mean over micro-batches and replicas
    lr: float
    grad_norm: float
    step_time: float  # seconds, slowest rank: the schedule (on DeepSpeed, its train_batch: the whole step)
    tokens_per_s: float  # whole world
    stage_times: list[float] = field(default_factory=list)  # per pipeline rank: step wall time
    forward_times: list[float] = field(default_factory=list)  # per pipeline rank: time in forward
    skipped: bool = False  # fp16 overflow: no update this step
    loss_scale: float = 1.0
    # per pipeline rank: bytes at the step's peak above the rank's baseline (autopipe.runtime.logs.peak),
    # what the plan's rank_memory predicts
    peak_memory: list[int] = field(default_factory=list)
    # whether peak_memory counts what the plan counts (autopipe.runtime.logs.peak: a CPU rank only with
    # train.py --exact-memory); else it is the resident peak of glibc's heap, with its free blocks
    memory_exact: bool = True
    # seconds of the whole step on rank 0: the schedule, the norm, the optimizer step, what the runtime
    # does between (what Plan.predicted_step predicts); 0: not measured apart (step_time is the whole)
    whole_step_time: float = 0.0

    @property
    def whole_step(self) -> float:
        """The whole step's seconds: what the plan's predicted step is set beside. Never under the
        slowest rank's schedule (rank 0's clock starts at its own first op; a first step's ranks start apart)."""
        return max(self.whole_step_time, self.step_time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
