"""What both engines' steps share: the settings (``TrainConfig``), the optimizer and its LR
schedule, fp16 loss scaling, the tied-gradient sum and global-norm clip, and evaluation.

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "EvalResult": "evaluate",
    "Evaluator": "evaluate",
    "eval_figures": "evaluate",
    "clip_grads_": "grads",
    "global_grad_norm": "grads",
    "sync_tied_grads": "grads",
    "LR_SCHEDULES": "optim",
    "LossScaler": "optim",
    "OPTIMIZERS": "optim",
    "TrainConfig": "optim",
    "check_zero": "optim",
    "describe_optimizer": "optim",
    "lr_factor": "optim",
    "make_lr_scheduler": "optim",
    "make_optimizer": "optim",
    "optimizer_class": "optim",
    "optimizer_options": "optim",
    "param_groups": "optim",
    "preallocate_": "optim",
    "preflight": "preflight",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
