"""Evaluation during training: forward-only through the pipeline on held-out data.

``--eval-data FILE`` is read like ``--data`` (the same formats and checks), in its own order
(no shuffling: evaluation ``k`` always sees the same rows). Every ``--eval-every N`` steps, and at
the end, the trainer runs ``--eval-steps`` batches of the training batch's size (default: one pass
over the file, the last partial batch left out) forward only, the model in eval mode (dropout
off), each replica on its own rows; rank 0 logs:

- ``eval_loss``: the mean micro-batch loss (the loss training uses, unscaled);
- ``eval_perplexity``: ``exp(eval_loss)`` for language models (a token cross-entropy: causal,
  masked and seq2seq LMs, or ``--loss cross_entropy`` on a token stream);
- ``eval_accuracy``: the share of rows whose argmax class is the label, for classifiers (a
  classification head, or ``--loss cross_entropy`` on one row of logits each).

The sums are kept on the device and read once per evaluation (one all-reduce over the world).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import AutopipeError
from ..data.losses import model_outputs_logits

__all__ = ["EvalResult", "Evaluator", "eval_figures"]


@dataclass(frozen=True)
class EvalResult:
    """One evaluation's figures."""

    loss: float
    perplexity: float | None  # language models
    accuracy: float | None  # classifiers
    batches: int
    rows: int  # rows evaluated, all replicas together

    def fields(self) -> dict[str, float]:
        """The log record's fields: ``eval_loss`` and, where they apply, ``eval_perplexity``, ``eval_accuracy``."""
        out = {"eval_loss": self.loss}
        if self.perplexity is not None:
            out["eval_perplexity"] = self.perplexity
        if self.accuracy is not None:
            out["eval_accuracy"] = self.accuracy
        return out


class Evaluator:
    """Evaluates ``trainer`` on ``data`` (a ``JobData`` made with ``shuffle=False``), collectively.

    Args:
        trainer: the torch ``Trainer`` or the ``DeepSpeedTrainer`` (both have ``evaluate``).
        data: the evaluation data.
        rows: rows per evaluation batch, all replicas together (the training step's).
        steps: batches per evaluation (None: one pass over the data).
        every: evaluate after every ``every`` training steps (0: only at the end).
    """

    def __init__(self, trainer: Any, data: Any, *, rows: int, steps: int | None = None, every: int = 0) -> None:
        if every < 0 or (steps is not None and steps < 1):
            raise AutopipeError(f"--eval-every {every} must be >= 0 and --eval-steps {steps} >= 1.")
        n = data.size
        if steps is None:
            if n is None:
                raise AutopipeError("--eval-data is synthetic here; give --eval-steps N, or a file.")
            steps = max(1, n // rows)
        self.trainer, self.data, self.rows, self.steps, self.every = trainer, data, rows, steps, every
        self.last: int | None = None  # the step evaluated last

    def due(self, step: int, steps: int) -> bool:
        """Whether to evaluate after training step ``step`` of ``steps``."""
        return (self.every > 0 and step % self.every == 0) or step == steps

    def describe(self) -> str:
        """What each evaluation runs, for the run's first lines."""
        n = self.data.size
        covered = f" of {n}" if n is not None else ""
        return (f"eval: {self.data.path or 'synthetic'}, {self.steps} batch(es) of {self.rows} rows "
                f"({min(n or self.steps * self.rows, self.steps * self.rows)}{covered} rows), "
                f"{'every ' + str(self.every) + ' steps and ' if self.every else ''}at the end")

    def __call__(self) -> EvalResult:
        trainer, data = self.trainer, self.data
        env = trainer.env
        sums = torch.zeros(4, dtype=torch.float64, device=env.device)
        for k in range(self.steps):
            args, kwargs, target = data.batch(k, self.rows, replica=env.dp_rank, replicas=env.dp_size,
                                              inputs=trainer.is_first, target=trainer.is_last)
            labels = None
            if trainer.is_last and data.classifier:
                labels = data.class_labels(k, self.rows, replica=env.dp_rank, replicas=env.dp_size)
            sums += trainer.evaluate(args, kwargs, target, labels).to(sums.device)
        sums = _all_reduce(env, sums)
        self.last = trainer.step_count
        loss_sum, micro, correct, labelled = sums.tolist()  # the evaluation's one host read
        loss = loss_sum / max(micro, 1)
        perplexity = math.exp(min(loss, 700.0)) if data.language_model else None
        accuracy = correct / labelled if data.classifier and labelled else None
        return EvalResult(loss, perplexity, accuracy, self.steps, self.steps * self.rows)


def eval_figures(outputs: Any, loss: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """One micro-batch's evaluation figures as a float64 tensor: (loss, 1, correct rows, labelled
    rows); the last two count the rows whose predicted class (the logits' argmax) is ``labels``'
    (-100 rows are left out), 0 without labels."""
    out = torch.zeros(4, dtype=torch.float64, device=loss.device)
    out[0] = loss.detach().double()
    out[1] = 1
    if labels is not None:
        logits = model_outputs_logits(outputs)
        labels = labels.reshape(-1).to(logits.device)
        kept = labels >= 0
        out[2] = (logits.reshape(labels.numel(), -1).argmax(-1) == labels)[kept].sum()
        out[3] = kept.sum()
    return out


def _all_reduce(env: Any, t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over the world (the torch engine's Comm, or torch.distributed under DeepSpeed)."""
    comm = getattr(env, "comm", None)
    if comm is not None:
        return comm.all_reduce(t, where="evaluation figures")
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t
