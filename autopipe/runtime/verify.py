"""``--verify``: one pipelined forward/backward against the same layers run unpipelined, before training.

No rank builds the whole model: each rank runs its own chunks twice on the same batch, first under
the schedule (as training does), then plainly, micro-batch after micro-batch and chunk after chunk,
handing activations forward and gradients back to the rank of the next chunk one at a time, as the
model's own forward and backward would run them (``Comm.send``/``recv``). Same weights (the rank's
own), same RNG seeds per layer and micro-batch, so dropout draws the same masks. The loss (on the
last stage) and every gradient the rank holds are compared, the verdict is agreed over all ranks,
and the gradients are cleared, so training starts as if nothing had run.

What it checks: the schedule, the stage-to-stage traffic, tied-gradient sums and data-parallel
averaging. That the flattened layers are the model is checked when they are made (``flatten``
compares them with the model's own outputs and gradients, and ``autopipe convert`` does).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import AutopipeError
from .engine import model_loss, pack_batch, split_batch
from .grads import sync_tied_grads

__all__ = ["VerifyError", "VerifyReport", "verify_step"]


class VerifyError(AutopipeError):
    """The pipelined step does not reproduce the unpipelined one."""


@dataclass(frozen=True)
class VerifyReport:
    loss: float  # the pipeline's (mean over micro-batches and replicas)
    reference_loss: float
    max_grad_diff: float  # worst |pipeline - reference| over every rank's gradients
    worst: str  # the parameter where it happened (this rank's view)
    ok: bool


def verify_step(
    trainer: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    target: Any = None,
    *,
    atol: float | None = None,
    rtol: float | None = None,
    raise_on_mismatch: bool = True,
) -> VerifyReport:
    """Compare one pipelined step's loss and gradients with the unpipelined run (collective call).

    ``args``/``kwargs``/``target`` are this replica's batch, as ``Trainer.step`` takes it.
    Tolerances default to 1e-5 absolute / 1e-4 relative in fp32, 1e-3 / 1e-2 under bf16/fp16.
    """
    env, cfg = trainer.env, trainer.config
    if env.dp_size > 1:
        # the replicas' engines reduce inside the schedule; the unpipelined twin runs the chunks
        # outside it, where they would reduce per micro-batch, or not at all
        raise AutopipeError("--verify compares one replica with the unpipelined run: run it with --dp 1 (same plan).")
    # half-precision sums in another order (micro-batch accumulation, loss scale) differ by ~1e-5
    default_atol, default_rtol = (1e-5, 1e-4) if cfg.dtype == "fp32" else (1e-3, 1e-2)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    params = trainer.params

    # ---- the pipelined step (without the optimizer) ----
    inputs = None
    if trainer.engine.is_first:
        inputs = env.to_device(pack_batch(trainer.build.seq, args, dict(kwargs or {}), cfg.microbatches))
    loss_t = trainer.engine.run(inputs, env.to_device(target) if trainer.engine.is_last else None, trainer.seeds())
    trainer.build.fold_alias_grads_()
    if trainer.scaler.enabled:  # fp16: gradients of the scaled loss
        for p in params.values():
            if p.grad is not None:
                p.grad.div_(trainer.scaler.scale)
    _finish_grads(trainer)
    piped = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)) for n, p in params.items()}
    trainer.optimizer.zero_grad(set_to_none=False)

    # ---- the same layers, unpipelined ----
    ref_loss_t = _unpipelined(trainer, args, kwargs, target)
    trainer.build.fold_alias_grads_()
    _finish_grads(trainer)

    worst, worst_name, bad = 0.0, "", False
    for name, p in params.items():
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        got = piped[name]
        diff = float((got - ref).abs().max()) if p.numel() else 0.0
        if diff > worst:
            worst, worst_name = diff, name
        if not torch.allclose(got, ref, atol=atol, rtol=rtol):
            bad = True
    loss = float(loss_t) if loss_t is not None else None
    ref_loss = float(ref_loss_t) if ref_loss_t is not None else None
    if loss is not None and ref_loss is not None and abs(loss - ref_loss) > atol + rtol * abs(ref_loss):
        bad = True
    # the losses live on the last stage of each replica: sum their shares; the verdict and the
    # worst difference: max over ranks
    has_loss = loss is not None
    values = [1.0 if bad else 0.0, worst]
    verdict = torch.tensor(values, dtype=torch.float64, device=env.device)
    env.comm.all_reduce(verdict, op="max", where="verify verdict")
    losses = torch.tensor([loss / env.dp_size if has_loss else 0.0, ref_loss / env.dp_size if has_loss else 0.0],
                          dtype=torch.float64, device=env.device)
    env.comm.all_reduce(losses, where="verify losses")
    trainer.optimizer.zero_grad(set_to_none=False)  # the trainer keeps its gradients allocated
    report = VerifyReport(float(losses[0]), float(losses[1]), float(verdict[1]), worst_name, not bool(verdict[0]))
    if not report.ok and raise_on_mismatch:
        raise VerifyError(
            f"the pipelined step differs from the same layers run unpipelined: loss {report.loss:.6f} vs "
            f"{report.reference_loss:.6f}, largest gradient difference {report.max_grad_diff:.2e} "
            f"(tolerance atol={atol}, rtol={rtol}; worst on this rank: {worst_name or '-'}); "
            "report the model, the plan and the schedule."
        )
    return report


def _finish_grads(trainer: Any) -> None:
    env = trainer.env
    sync_tied_grads(trainer.params, trainer.build.tied_here(), env.tied_groups, env.comm)


def _unpipelined(trainer: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None, target: Any) -> torch.Tensor | None:
    """Forward and backward of every micro-batch through the chunks in order, one chunk at a time
    across the ranks; returns the mean loss on the rank of the last chunk (None elsewhere)."""
    env, cfg, build = trainer.env, trainer.config, trainer.build
    layout = build.layout
    m = cfg.microbatches
    chunks = {c.index: c for c in build.chunks}
    last = layout.num_chunks - 1
    owner = lambda c: env.global_rank(env.dp_rank, layout.owner(c))  # noqa: E731
    seeds = trainer.seeds()
    for chunk in chunks.values():
        chunk.start_step(seeds)
    micro = None
    if 0 in chunks:
        micro = [env.to_device(build.seq.pack_inputs(a, k)) for a, k in split_batch(args, dict(kwargs or {}), m)]
    targets = list(env.to_device(target).chunk(m)) if (last in chunks and isinstance(target, torch.Tensor)) else [None] * m
    loss_fn = trainer.engine._user_loss
    total = torch.zeros((), dtype=torch.float64, device=env.device)
    for j in range(m):
        saved: dict[int, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {}
        handed: tuple[torch.Tensor, ...] | None = None
        loss = None
        for c in range(last + 1):
            if c not in chunks:
                continue
            if c == 0:
                xs = tuple(micro[j])  # type: ignore[index]
            else:
                got = handed if owner(c - 1) == env.rank else tuple(env.comm.recv(owner(c - 1), where="verify activations"))
                xs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in got)  # type: ignore[union-attr]
            out = chunks[c](*xs)
            outs = out if isinstance(out, tuple) else (out,)
            saved[c] = (xs, outs)
            if c == last:  # the loss outside autocast, as the engine computes it
                outputs = build.seq.unpack_outputs(out)
                loss = model_loss(outputs) if loss_fn is None else loss_fn(outputs, targets[j])
            elif owner(c + 1) == env.rank:
                handed = tuple(t.detach() for t in outs)
            else:
                env.comm.send([t.detach() for t in outs], owner(c + 1), where="verify activations")
        grads_in: tuple[torch.Tensor, ...] | None = None
        for c in range(last, -1, -1):
            if c not in chunks:
                continue
            xs, outs = saved[c]
            if c == last:
                (loss / m).backward()  # type: ignore[union-attr]
                total += loss.detach().double() / m  # type: ignore[union-attr]
            else:
                grads = grads_in if owner(c + 1) == env.rank else tuple(env.comm.recv(owner(c + 1), where="verify gradients"))
                pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]  # type: ignore[arg-type]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            if c > 0:
                back = [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]
                if owner(c - 1) == env.rank:
                    grads_in = tuple(back)
                else:
                    env.comm.send(back, owner(c - 1), where="verify gradients")
    return total if last in chunks else None
