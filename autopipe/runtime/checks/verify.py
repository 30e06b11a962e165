"""``--verify``: one pipelined forward/backward against the user's model, untouched, before training.

The reference is the model as its factory builds it, called through its own ``forward`` at the job's
weights on the same micro-batches (``autopipe.runtime.checks.untouched``), never the flattened layers: a
trace that took another branch, a buffer built otherwise, a loss picked wrongly all show. Each
rank runs its chunks under the schedule (as training does), capturing the last chunk's outputs;
then every rank runs the whole untouched model, micro-batch by micro-batch, seeded where each layer
starts as the pipeline seeds it (dropout draws the same masks). Compared: the outputs and the loss
(on the rank of the last chunk) and every gradient each rank holds; the verdict is agreed over all
ranks, and the gradients are cleared, so training starts as if nothing had run.

With replicas (``--dp``, any ZeRO stage, ``--ep``) the untouched model runs the global batch: every
replica's micro-batches in replica order, seeded as each replica seeds them, the loss their mean.
Each rank's gradients are compared after the trainer settles them (``Trainer.settle_gradients``:
the data-parallel mean, expert slices summed over their groups, tied copies summed), whole: a
ZeRO 2/3 shard or a tp shard gathered over its mesh, an expert slice over its ep group. A replica's
outputs and loss are compared with the untouched model's on that replica's micro-batches.

What it costs: the whole model once on every rank, for one step. What it checks beyond the layers:
the schedule, the stage-to-stage traffic, tied-gradient sums.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ...errors import AutopipeError
from ..data.batches import pack_batch, split_batch
from ..data.losses import model_loss
from .untouched import seeded_like_pipeline, untouched_model

__all__ = ["VerifyError", "VerifyReport", "verify_step"]


class VerifyError(AutopipeError):
    """The pipelined step does not reproduce the user's model."""


@dataclass(frozen=True)
class VerifyReport:
    loss: float  # the pipeline's (mean over micro-batches and replicas)
    reference_loss: float  # the untouched model's
    max_grad_diff: float  # worst |pipeline - untouched| over every rank's gradients
    worst: str  # the parameter where it happened (this rank's view)
    ok: bool
    max_output_diff: float = 0.0  # worst |pipeline - untouched| over the model's outputs

    def line(self) -> str:
        """What train.py prints of it."""
        return (f"verify: loss {self.loss:.6f} vs the untouched model's {self.reference_loss:.6f}, max output "
                f"diff {self.max_output_diff:.1e}, max grad diff {self.max_grad_diff:.1e}: {'ok' if self.ok else 'MISMATCH'}")


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
    """Compare one pipelined step's outputs, loss and gradients with the untouched model's (collective call).

    ``args``/``kwargs``/``target`` are this replica's batch, as ``Trainer.step`` takes it (a rank
    that reads neither inputs nor targets may pass placeholders: the untouched model runs on the
    batches the first and last chunks' ranks of every replica read, shared with every rank).
    Tolerances default to 1e-5 absolute / 1e-4 relative in fp32, 1e-3 / 1e-2 under bf16/fp16.
    """
    env, cfg, build = trainer.env, trainer.config, trainer.build
    if build.model_fn is None:
        raise AutopipeError("--verify needs the model's factory: build the stage with build_stage(model_fn, ...).")
    # half-precision sums in another order (micro-batch accumulation, loss scale) differ by ~1e-5
    default_atol, default_rtol = (1e-5, 1e-4) if cfg.dtype == "fp32" else (1e-3, 1e-2)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    params = trainer.params

    # ---- the pipelined step (without the optimizer), the last chunk's outputs kept ----
    outputs: list[tuple[torch.Tensor, ...]] = []
    handles = [chunk.register_forward_hook(lambda mod, a, out: _keep(mod, out, outputs))
               for chunk in trainer.engine.chunks if chunk.layer_range[1] == build.plan.num_layers]
    inputs = None
    if trainer.engine.is_first:
        inputs = env.to_device(pack_batch(build.seq, args, dict(kwargs or {}), cfg.microbatches))
    try:
        loss_t = trainer.engine.run(inputs, env.to_device(target) if trainer.engine.is_last else None, trainer.seeds())
    finally:
        for h in handles:
            h.remove()
    trainer.settle_gradients()  # as the step has them before its norm: unscaled, reduced, tied copies summed
    # whole gradients: a tp or ZeRO shard gathered over its mesh, an expert slice over its ep group (in
    # the same order on every rank of a stage)
    piped = {n: _whole(trainer._whole(n, p.grad.detach() if p.grad is not None else torch.zeros_like(p)))
             for n, p in params.items()}
    trainer.zero_gradients()

    # ---- the user's model, untouched, on the global batch (every rank runs all of it) ----
    model = untouched_model(build.model_fn, seed=build.seed, weights=build.weights, device=env.device)
    ref_outputs, ref_losses = _run_untouched(trainer, model, _replica_batches(trainer, args, kwargs, target))
    m, r = cfg.microbatches, env.dp_rank
    mine = sum(ref_losses[r * m:(r + 1) * m]) / m  # this replica's micro-batches: what its pipeline's loss is
    ref_outputs = ref_outputs[r * m:(r + 1) * m]

    bad = False
    worst_out = 0.0
    if trainer.engine.is_last:
        for got, ref in zip(outputs, ref_outputs):
            for g, r in zip(_leaves(build.seq.unpack_outputs(got)), ref):
                diff = float((g.float() - r.float()).abs().max()) if g.shape == r.shape and g.numel() else (
                    0.0 if g.shape == r.shape else float("inf"))
                worst_out = max(worst_out, diff)
                bad |= g.shape != r.shape or not torch.allclose(g.float(), r.float(), atol=atol, rtol=rtol)
        bad |= len(outputs) != len(ref_outputs)
    worst, worst_name = 0.0, ""
    for name, got in piped.items():
        p = model.get_parameter(name)
        ref = p.grad if p.grad is not None else torch.zeros_like(p)
        diff = float((got - ref).abs().max()) if p.numel() else 0.0
        if diff > worst:
            worst, worst_name = diff, name
        if not torch.allclose(got, ref, atol=atol, rtol=rtol):
            bad = True
    loss = float(loss_t) if loss_t is not None else None
    if loss is not None and abs(loss - mine) > atol + rtol * abs(mine):
        bad = True
    # the loss lives on each replica's last stage: their mean; the verdict and the worst differences: max over ranks
    has_loss = loss is not None and getattr(env, "tp_rank", 0) == 0  # tp ranks hold the same loss: one counts
    verdict = torch.tensor([1.0 if bad else 0.0, worst, worst_out], dtype=torch.float64, device=env.device)
    env.comm.all_reduce(verdict, op="max", where="verify verdict")
    losses = torch.tensor([loss if has_loss else 0.0, mine if has_loss else 0.0], dtype=torch.float64, device=env.device)
    env.comm.all_reduce(losses, where="verify losses")
    losses /= env.dp_size
    trainer.zero_gradients()  # kept allocated, as the trainer keeps them
    # the untouched copy's blocks go back to the GPU: the caching allocator kept them reserved, and
    # every step's logged peak then counted it (H200, bf16 GPT-2: 27.4 GiB logged, 16.7 without --verify)
    model = ref_outputs = outputs = piped = p = ref = g = r = None  # the loops' names hold its last tensors too
    if env.device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    report = VerifyReport(float(losses[0]), float(losses[1]), float(verdict[1]), worst_name, not bool(verdict[0]),
                          float(verdict[2]))
    if not report.ok and raise_on_mismatch:
        worst_name = _worst_anywhere(env, worst, worst_name)
        raise VerifyError(
            f"the pipelined step differs from the untouched model: loss {report.loss:.6f} vs {report.reference_loss:.6f}, "
            f"largest output difference {report.max_output_diff:.2e}, largest gradient difference "
            f"{report.max_grad_diff:.2e} (tolerance atol={atol}, rtol={rtol}; worst: {worst_name or '-'}); "
            "report the model, the plan and the schedule."
        )
    return report


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of ``t``'s whole value: a DTensor (tp, ZeRO 2/3, an expert slice as the trainer's
    ``_whole`` views it) gathered over its mesh (collective)."""
    full = getattr(t, "full_tensor", None)
    return full().clone() if full is not None else t.clone()


def _worst_anywhere(env: Any, worst: float, name: str) -> str:
    """The parameter with the largest gradient difference over all ranks, and the rank holding it."""
    if env.world == 1:
        return name
    import torch.distributed as dist

    rows = env.comm.all_gather(torch.tensor([worst], dtype=torch.float64, device=env.device), where="verify worst")
    rank = int(rows.view(-1).argmax())
    box = [name]
    dist.broadcast_object_list(box, src=rank, device=env.device if env.device.type == "cuda" else None)
    return f"{box[0]} on rank {rank}"


Batch = tuple[Sequence[Any], Mapping[str, Any] | None, Any]


def _replica_batches(trainer: Any, args: Sequence[Any], kwargs: Mapping[str, Any] | None, target: Any
                     ) -> list[Batch]:
    """Every replica's batch, in replica order, as its first chunk's rank read it (inputs) and its last
    chunk's (target), on every rank: a middle rank reads neither (train.py's get_batch gives it
    placeholders), and a zbv rank 0 holding both ends while rank 1 ran the untouched model on zeros
    was a 1.2 gradient "mismatch"."""
    env, plan = trainer.env, trainer.build.plan
    if env.world == 1 or (env.pp_size == 1 and env.dp_size == 1):
        return [(args, kwargs, target)]
    import torch.distributed as dist

    host = lambda tree: pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, tree)  # noqa: E731
    device = env.device if env.device.type == "cuda" else None
    batches: list[Batch] = []
    for replica in range(env.dp_size):
        # tp rank 0 of the replica's first and last chunks' stages (every tp rank of a stage holds the same batch)
        first = env.global_rank(replica, plan.owner(0), 0)
        last = env.global_rank(replica, plan.owner(plan.num_chunks - 1), 0)
        inputs = [host((tuple(args), dict(kwargs or {}))) if env.rank == first else None]
        dist.broadcast_object_list(inputs, src=first, device=device)
        targets = [host(target) if env.rank == last else None]
        dist.broadcast_object_list(targets, src=last, device=device)
        batches.append((inputs[0][0], inputs[0][1], targets[0]))  # type: ignore[index]
    return batches


def _keep(chunk: Any, out: Any, into: list[tuple[torch.Tensor, ...]]) -> None:
    """The last chunk's output of one micro-batch (not the schedule's shape-inference pass on meta)."""
    outs = out if isinstance(out, tuple) else (out,)
    if not getattr(chunk, "shape_inference", False) and not any(t.is_meta for t in outs):
        into.append(tuple(t.detach().clone() for t in outs))


def _leaves(tree: Any) -> list[torch.Tensor]:
    return [x.detach() for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _run_untouched(trainer: Any, model: torch.nn.Module, batches: Sequence[Batch]
                   ) -> tuple[list[list[torch.Tensor]], list[float]]:
    """Forward and backward of every replica's every micro-batch through the model's own forward, as
    the trainer's engine computes the loss (outside autocast; the gradient of the mean over the
    global batch's micro-batches, as the replicas' reduced one is); returns each micro-batch's output
    tensors and loss, replica by replica."""
    env, cfg = trainer.env, trainer.config
    m = cfg.microbatches
    count = m * len(batches)
    loss_fn = trainer.engine._user_loss
    outs: list[list[torch.Tensor]] = []
    losses: list[float] = []
    dtype = cfg.autocast_dtype
    # micro-batch i of replica r is the global batch's r*m + i: seeded as that replica seeds it
    with seeded_like_pipeline(model, trainer.build.seq.layer_entries, replace(trainer.seeds(), first=0)):
        for args, kwargs, target in batches:
            args, kwargs, target = env.to_device((tuple(args), dict(kwargs or {}), target))
            targets = list(target.chunk(m)) if isinstance(target, torch.Tensor) else [None] * m
            for (a, k), t in zip(split_batch(args, kwargs, m), targets):
                with torch.autocast(env.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    out = model(*a, **k)
                loss = model_loss(out) if loss_fn is None else loss_fn(out, t)
                (loss / count).backward()
                losses.append(float(loss.detach()))
                outs.append(_leaves(out))
    return outs, losses
