"""``--verify``: one pipelined forward/backward against the unpipelined model, before training.

Every rank builds the whole reference model (same weights by construction), runs the same global
batch through it micro-batch by micro-batch, and compares the loss (on the last stage) and the
gradient of each parameter it holds. The verdict is agreed over all ranks; the trainer's own
gradients are cleared afterwards, so training starts as if nothing had run. Dropout must be off
(the pipeline and the reference draw different random masks).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import AutopipeError
from .build import build_reference
from .engine import pack_batch
from .grads import average_dp_grads, sync_tied_grads
from .reference import ReferenceTrainer

__all__ = ["VerifyError", "VerifyReport", "verify_step"]


class VerifyError(AutopipeError):
    """The pipelined step does not reproduce the unpipelined one."""


@dataclass(frozen=True)
class VerifyReport:
    loss: float  # the pipeline's (0 on ranks without the last stage)
    reference_loss: float
    max_grad_diff: float  # worst |pipeline - reference| over this rank's gradients, then over ranks
    worst: str  # the parameter where it happened (this rank's view)
    ok: bool


def verify_step(
    trainer: Any,
    model_fn: Callable[[], nn.Module],
    global_args: Sequence[Any],
    global_kwargs: Mapping[str, Any] | None = None,
    global_target: Any = None,
    *,
    local_args: Sequence[Any] | None = None,
    local_kwargs: Mapping[str, Any] | None = None,
    local_target: Any = None,
    weights: str | None = None,
    atol: float | None = None,
    rtol: float | None = None,
    raise_on_mismatch: bool = True,
) -> VerifyReport:
    """Compare one pipelined step's loss and gradients with the reference (collective call).

    Tolerances default to 1e-5 absolute / 1e-4 relative in fp32, 1e-3 / 1e-2 under bf16/fp16.

    ``global_*`` is the whole step's batch (all replicas); ``local_*`` this replica's share (defaults
    to the global batch when there is one replica).
    """
    env = trainer.env
    cfg = trainer.config
    # half-precision sums in another order (micro-batch accumulation, loss scale) differ by ~1e-5
    default_atol, default_rtol = (1e-5, 1e-4) if cfg.dtype == "fp32" else (1e-3, 1e-2)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    local_args = global_args if local_args is None else local_args
    local_kwargs = global_kwargs if local_kwargs is None else local_kwargs
    local_target = global_target if local_target is None else local_target

    inputs = None
    if trainer.engine.is_first:
        inputs = env.to_device(pack_batch(trainer.build.seq, local_args, dict(local_kwargs or {}), cfg.microbatches))
    loss_t = trainer.engine.run(inputs, env.to_device(local_target) if trainer.engine.is_last else None)
    loss = None if loss_t is None else float(loss_t)
    trainer.build.fold_alias_grads_()
    if trainer.scaler.enabled:  # fp16: gradients of the scaled loss
        for p in trainer.params.values():
            if p.grad is not None:
                p.grad.div_(trainer.scaler.scale)
    sync_tied_grads(trainer.params, trainer.build.tied_here(), env.tied_groups, env.comm)
    average_dp_grads(trainer.params, env.dp_group, env.dp_size, env.comm)

    reference = ReferenceTrainer(build_reference(model_fn, seed=cfg.seed, weights=weights, device=env.device), cfg)
    ref_loss = reference.forward_backward(
        global_args, global_kwargs, global_target, microbatches=cfg.microbatches * env.dp_size
    )
    worst, worst_name, bad = 0.0, "", False
    for name, p in trainer.params.items():
        ref = reference.model.get_parameter(name).grad
        got = p.grad if p.grad is not None else torch.zeros_like(p)
        ref = ref if ref is not None else torch.zeros_like(p)
        diff = float((got - ref).abs().max()) if p.numel() else 0.0
        if diff > worst:
            worst, worst_name = diff, name
        if not torch.allclose(got, ref, atol=atol, rtol=rtol):
            bad = True
    if loss is not None and abs(loss - ref_loss) > atol + rtol * abs(ref_loss):
        bad = True
    # the loss lives on the last stage; MAX over ranks hands it to everyone (others hold -inf)
    values = [1.0 if bad else 0.0, worst, loss if loss is not None else -math.inf]
    verdict = torch.tensor(values, dtype=torch.float64, device=env.device)
    env.comm.all_reduce(verdict, op="max", where="verify verdict")
    loss = float(verdict[2])
    trainer.optimizer.zero_grad(set_to_none=False)  # the trainer keeps its gradients allocated
    report = VerifyReport(loss, ref_loss, float(verdict[1]), worst_name, not bool(verdict[0]))
    if not report.ok and raise_on_mismatch:
        raise VerifyError(
            f"the pipelined step differs from the unpipelined model: loss {report.loss:.6f} vs "
            f"{report.reference_loss:.6f}, largest gradient difference {report.max_grad_diff:.2e} "
            f"(tolerance atol={atol}, rtol={rtol}; worst on this rank: {worst_name or '-'}). Check that "
            "dropout is off, then report the model and plan: the flattened graph may be wrong."
        )
    return report
