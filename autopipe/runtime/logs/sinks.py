"""Where a run's step records go besides the terminal: JSON lines, TensorBoard, Weights & Biases.

Each record is one dict per step, the same for every sink: ``StepStats`` (loss, lr, grad_norm,
step_time, tokens_per_s, stage_times, peak_memory, ...), the plan's predictions when the run is the
one planned, the progress figures (``eta_s``, ``model_flops_per_s``, ``mfu``) and, after an
evaluation, ``eval_loss``, ``eval_perplexity`` and ``eval_accuracy``. Only rank 0 writes.

- ``JsonLines``: ``--log-json PATH``, one line per step. After ``--resume`` at step S the lines of
  steps after S (a run that stopped after its last checkpoint logged them) are dropped, so the file
  has each step once.
- ``TensorBoard``: ``--tensorboard [DIR]``, event files through ``torch.utils.tensorboard`` (the
  ``tensorboard`` package); every number of a record is a scalar of that name, a list one scalar
  per item (``peak_memory/0``). A resumed run purges the events after its step.
- ``WandB``: ``--wandb PROJECT``, when ``wandb`` is installed (a clear line when it is not); the
  run's flags are its config.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ...errors import AutopipeError

__all__ = ["JsonLines", "TensorBoard", "WandB", "scalars"]


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """Every number in ``record`` by name, lists as ``name/i`` (booleans as 0/1; None left out).

    >>> scalars({"step": 3, "loss": 2.5, "peak_memory": [10, 20], "skipped": False, "note": "x"})
    {'step': 3.0, 'loss': 2.5, 'peak_memory/0': 10.0, 'peak_memory/1': 20.0, 'skipped': 0.0}
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, (bool, int, float)):
                    out[f"{key}/{i}"] = float(item)
    return out


class JsonLines:
    """Appends one JSON line per record to ``path``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def resumed(self, step: int) -> None:
        """Drop the lines of steps after ``step``, which this run trains again (written atomically)."""
        if not self.path.is_file():
            return
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                kept.append(line)  # not ours to judge: kept as it was
                continue
            if not isinstance(record, dict) or int(record.get("step", 0)) <= step:
                kept.append(line)
        part = self.path.with_name(self.path.name + ".part")
        part.write_text("".join(f"{line}\n" for line in kept))
        os.replace(part, self.path)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        pass


class TensorBoard:
    """TensorBoard event files in ``log_dir`` (``torch.utils.tensorboard.SummaryWriter``)."""

    def __init__(self, log_dir: str | os.PathLike[str], *, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise AutopipeError("--tensorboard needs the tensorboard package: pip install tensorboard.") from None
        self._writer_class = SummaryWriter
        self.log_dir = Path(log_dir)
        self.writer = self._open(resume_step)

    def _open(self, resume_step: int | None) -> Any:
        # a resumed run writes its steps again: events from a step after the checkpoint are purged
        purge = None if resume_step is None else resume_step + 1
        return self._writer_class(log_dir=str(self.log_dir), purge_step=purge)

    def resumed(self, step: int) -> None:
        """TensorBoard purges when a writer starts: start again, purging what this run trains again."""
        self.writer.close()
        self.writer = self._open(step)

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for name, value in scalars(record).items():
            if name != "step":
                self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandB:
    """A Weights & Biases run in ``project`` (``wandb.init``), the run's flags as its config."""

    def __init__(self, project: str, *, config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError:
            raise AutopipeError(f"--wandb {project} needs Weights & Biases: pip install wandb (or leave --wandb out).") from None
        self.wandb = wandb
        self.run = wandb.init(project=project, config=dict(config or {}))

    def resumed(self, step: int) -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        data = scalars(record)
        step = int(data.pop("step"))
        self.run.log(data, step=step)

    def close(self) -> None:
        self.run.finish()
