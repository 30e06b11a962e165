"""Data parallelism across the replicas of each pipeline stage: ZeRO 0-3 on torch's own engines.

Each pipeline chunk is wrapped over the data-parallel dimension of the (dp, pp) DeviceMesh. Which
engine runs ZeRO 0/1 depends on the schedule (``ddp_schedule``): schedules that run whole
backwards (GPipe, 1F1B, Interleaved1F1B, LoopedBFS) use DistributedDataParallel; zero-bubble ones
(ZBVZeroBubble, InterleavedZeroBubble, DualPipeV) keep ``replicate``:

| ``--zero`` | schedule | engine | overlap with backward | held beside weights, gradients, AdamW |
| --- | --- | --- | --- | --- |
| 0 | whole backward | ``DistributedDataParallel`` (one per chunk, ``gradient_as_bucket_view``) | yes: buckets all-reduce from autograd hooks in the last micro-batch's backward | nothing (the gradients are its buckets) |
| 1 | whole backward | DDP + ``ZeroRedundancyOptimizer`` | yes | AdamW state 1/R (whole tensors; owners broadcast updates) |
| 0 | zero-bubble | ``replicate`` (FSDP2 over a shard dim of one), per layer | no: one reduce after the stage's last backward | its own weight copy + an accumulated gradient |
| 1 | zero-bubble | ``replicate`` + ``ZeroRedundancyOptimizer`` | no | the same; AdamW state 1/R |
| 2 | any | ``fully_shard(reshard_after_forward=False)``, per layer | no | weights, gradients, AdamW 1/R at rest; whole weights + gradients during the step |
| 3 | any | ``fully_shard(reshard_after_forward=True)`` | no | the same, weights re-gathered for each micro-batch |

Why DDP where it can: ``PipelineStage`` runs a DDP submodule's forwards and all backwards but the
last under ``no_sync`` and arms DDP's reducer (``prepare_for_backward``) for the last micro-batch's
backward, so each bucket's all-reduce is launched as soon as its gradients are ready, while the
rest of that backward runs. A ``replicate``/FSDP module instead reduces once after the stage's
last backward (``perform_reduce_grad``), with nothing left to overlap, and ``replicate`` computes
with its own weight copy and accumulates an unsharded gradient beside the parameter's.

Why not DDP under zero-bubble schedules: their weight pass computes parameter gradients with
``torch.autograd.grad`` and sets ``.grad`` by hand (``stage_backward_weight``), which fires none of
DDP's hooks; only the first stage, whose weight pass is a whole backward, would be reduced.
Measured (dp 2 x pp 2, ZBV, DDP forced): the replicas of every other stage kept different
gradients, silently. ``replicate``'s explicit reduce after the last backward works there.

Scaling: DDP (and replicate, FSDP2) divide by the replica count inside the reduce; the stage then
divides by the micro-batch count (``scale_grads``): 1/R and 1/M each once, inside torch. Under
FSDP2 that also means, during the step, a stage holds its parameters unsharded
(``set_reshard_after_backward(False)``) and its gradients unsharded and accumulated until the
reduce-scatter: ZeRO 2/3 shrink what a rank holds between steps (parameters, sharded gradients,
optimizer state), not the step's peak of parameters and gradients.

With one replica there is nothing to shard: every ``--zero`` runs the plain stage (same numbers).

Under expert parallelism every engine above leaves the expert slices out (they differ between the
ranks of an ep group; autopipe.runtime.stage.expert_parallel reduces their gradients): whole on
their ranks, their AdamW state too, but on ZeRO 1, where a second ZeroRedundancyOptimizer shards
it over the expert data-parallel group (dp / ep replicas; ``zero_one.ZeroOneAdamW.experts``).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...choices import ZERO_STAGES
from ...errors import AutopipeError
from ...planner.memory import (
    ddp_schedule,  # the plan's memory model decides with the same rule
)
from ..stage.build import repoint_model_
from ..training.optim import TrainConfig

__all__ = ["DDP_BUCKET_CAP", "ZERO_STAGES", "bucket_bytes", "ddp_schedule", "explain_ddp_error", "shard_chunks_", "sharded_grads"]

DDP_BUCKET_CAP = 25 * 2**20  # DistributedDataParallel's default bucket cap, bytes
DDP_BUCKETS_PER_CHUNK = 4


def sharded_grads(zero: int, dp_size: int) -> bool:
    """Whether each replica holds a different slice of the gradients after the step's reduce."""
    return dp_size > 1 and zero >= 2


def _slots(chunks: Sequence[nn.Module], wanted: Mapping[int, str]) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, name) for every place a wanted parameter is registered in ``chunks``."""
    out = []
    for chunk in chunks:
        for mod in chunk.modules():
            for attr, p in mod._parameters.items():
                if p is not None and id(p) in wanted:
                    out.append((mod, attr, wanted[id(p)]))
    return out


def shard_chunks_(build: Any, chunks: Sequence[nn.Module], mesh: Any, zero: int, *,
                  schedule: str = "1F1B", param_dtype: torch.dtype | None = None, tp: int = 1,
                  ignored: set[int] | None = None) -> list[nn.Module]:
    """Wrap ``chunks`` (the modules the pipeline stages run) for data parallelism over ``mesh``
    (the 1-D data-parallel mesh) and return the modules the stages must run, in order.

    ZeRO 0/1 under a schedule that runs whole backwards (``ddp_schedule``): each chunk inside its
    own ``DistributedDataParallel``; the parameters stay the chunk's own tensors. Otherwise the
    chunks are wrapped in place (``replicate``, ``fully_shard``) and ``build.params`` /
    ``build.aliases`` point at the engine's parameters (DTensors from then on). Each layer is its
    own unit (a bucket of ``replicate``, a gather/reduce unit of FSDP), except one that shares a
    parameter with another layer of its chunk (a tied tensor used twice on one rank): the chunk
    itself manages that one.

    ``param_dtype`` (bf16 training): FSDP2 (ZeRO 2/3) gathers the weights in that dtype and the
    layers compute on them, its ``MixedPrecisionPolicy``; gradients are reduced and kept in fp32,
    beside the fp32 shards AdamW steps. Without it FSDP2 gathers fp32 weights: twice the traffic
    and the gathered memory, only for autocast to cast each weight down again at every matmul.

    ``tp`` > 1 (the parameters are DTensors on the stage's tp mesh): ZeRO 0 runs ``replicate`` and
    ZeRO 2/3 FSDP2 over the dp mesh, 2-D with the tp placements (torchtitan's layout); DDP, which
    takes no DTensor, is never used.

    ``ignored``: ids of parameters the engine leaves alone (expert slices under expert parallelism,
    which each rank holds alone and autopipe reduces itself): plain tensors, never reduced here.
    """
    ignored = ignored or set()
    if zero <= 1 and ddp_schedule(schedule) and tp == 1:  # DDP takes no DTensor (tensor-parallel) parameters
        return [_ddp(chunk, mesh.get_group(), ignored) for chunk in chunks]
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.fsdp import fully_shard

    names = {id(p): n for n, p in build.params.items()}
    alias_names = {id(leaf): (n, i) for n, leaves in build.aliases.items() for i, leaf in enumerate(leaves)}
    slots = _slots(chunks, {**names, **{k: f"\0alias:{n}:{i}" for k, (n, i) in alias_names.items()}})

    mixed = {}
    if param_dtype is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        mixed["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)

    def wrap(module: nn.Module) -> None:
        if zero <= 1:
            replicate(module, mesh=mesh, ignored_params={p for p in module.parameters() if id(p) in ignored} or None)
        else:
            fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3,
                        ignored_params={p for p in module.parameters() if id(p) in ignored} or None, **mixed)

    for chunk in chunks:
        counts: dict[int, int] = {}
        for layer in chunk.layers:
            for p in layer.parameters():
                counts[id(p)] = counts.get(id(p), 0) + 1
        for layer in chunk.layers:
            own = list(layer.parameters())
            if own and all(counts[id(p)] == 1 for p in own):
                wrap(layer)
        wrap(chunk)
    params: dict[str, nn.Parameter] = {}
    aliases: dict[str, list[nn.Parameter]] = {n: list(v) for n, v in build.aliases.items()}
    for mod, attr, name in slots:
        p = mod._parameters[attr]
        if name.startswith("\0alias:"):
            _, base, i = name.split(":")
            aliases[base][int(i)] = p
        else:
            params.setdefault(name, p)
    if set(params) != set(build.params):
        raise AutopipeError(f"data parallelism lost parameters {sorted(set(build.params) - set(params))[:3]}: report this model.")
    whole = build.params
    build.params = dict(sorted(params.items()))
    build.aliases = aliases
    repoint_model_(build, whole)  # else the model's modules keep every whole weight beside the shards
    return list(chunks)


def explain_ddp_error(error: BaseException, zero: int) -> BaseException:
    """DistributedDataParallel's multi-line complaint about parameters no loss used, as one line
    that says what to do; any other error unchanged.

    DDP runs without ``find_unused_parameters`` (it breaks non-reentrant recompute), so a chunk
    holding a parameter its forward never reads fails at the next step's forward.
    """
    if isinstance(error, RuntimeError) and "Expected to have finished reduction in the prior iteration" in str(error):
        return AutopipeError(
            f"--zero {zero}: a pipeline chunk has parameters its forward never uses, which "
            "DistributedDataParallel cannot all-reduce; use --zero 2 (FSDP2 reduces what it has), or freeze "
            "them (requires_grad=False) or remove them from the model."
        )
    return error


def bucket_bytes(chunk_bytes: int) -> int:
    """DDP's bucket cap for a chunk of ``chunk_bytes`` of trainable parameters: a quarter of the
    chunk, at most 25 MiB (DDP's own default).

    Why not DDP's default alone: a pipeline chunk is a slice of a model, often under 25 MiB, and a
    chunk in one bucket reduces only once its whole backward is done, so nothing overlaps. Four
    buckets let the first three reduce while the rest of the backward runs.

    >>> bucket_bytes(400), bucket_bytes(2**30) // 2**20
    (100, 25)
    """
    return max(1, min(DDP_BUCKET_CAP, -(-chunk_bytes // DDP_BUCKETS_PER_CHUNK)))


def _ddp(chunk: nn.Module, group: Any, ignored: set[int] | frozenset[int] = frozenset()) -> nn.Module:
    """``chunk`` inside DistributedDataParallel over ``group``, its gradients DDP's bucket views;
    the parameters in ``ignored`` (ids) left out of its reduce."""
    from torch.nn.parallel import DistributedDataParallel

    params = [p for p in chunk.parameters() if p.requires_grad and id(p) not in ignored]
    if not params:  # nothing to reduce (DDP refuses a module without trainable parameters)
        return chunk
    if ignored:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            chunk, [n for n, p in chunk.named_parameters(remove_duplicate=False) if id(p) in ignored])
    # Gradients made now become views of DDP's buckets when it builds them (a gradient made later,
    # by autograd, lives apart until DDP copies it in at the first reduce): one copy, allocated
    # before any activation, which the trainer's preallocate_ then leaves alone.
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    device = params[0].device
    return DistributedDataParallel(
        chunk,
        device_ids=[device] if device.type == "cuda" else None,
        process_group=group,
        bucket_cap_mb=bucket_bytes(sum(p.numel() * p.element_size() for p in params)) / 2**20,
        gradient_as_bucket_view=True,
        # the chunks' buffers (causal masks, position ids) are built alike on every replica and
        # training never changes them; the default would broadcast them before every micro-batch
        broadcast_buffers=False,
    )


def make_dp_optimizer(params: Mapping[str, nn.Parameter], config: TrainConfig, *, zero: int, dp_size: int,
                      group: Any, experts: Iterable[str] = (), expert_group: Any = None) -> torch.optim.Optimizer:
    """The optimizer for this rank: ``ZeroOneAdamW`` under ZeRO 1 with replicas, else torch's (whose
    state follows the parameters: sharded DTensors under ZeRO 2/3). ``experts``: the names of this
    rank's expert slices under ep, which ZeRO 1 steps apart, sharded over ``expert_group`` (None:
    one rank holds each slice's state whole)."""
    from ..training.optim import make_optimizer

    if zero == 1 and dp_size > 1:
        from .zero_one import ZeroOneAdamW

        held = {n: params[n] for n in experts}
        return ZeroOneAdamW(params, config, group, experts=held, expert_group=expert_group)
    return make_optimizer(params, config)


def is_zero_one(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is ZeRO 1's ``ZeroOneAdamW``, asked without importing it: its module
    imports torch.distributed.optim, whose optimizers torch scripts at import (about 1 s of CPU at
    every rank's start, where ZeRO 1 is rare)."""
    module = sys.modules.get(f"{__package__}.zero_one")
    return module is not None and isinstance(optimizer, module.ZeroOneAdamW)


def optimizer_state(optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter]) -> dict[str, dict[str, Any]]:
    """Parameter name -> the optimizer state this rank holds for it (all of it, or its share)."""
    if is_zero_one(optimizer):
        return optimizer.owned_state()  # type: ignore[attr-defined]
    return {n: optimizer.state[p] for n, p in params.items() if optimizer.state.get(p)}


def full_values(params: Iterable[tuple[str, nn.Parameter]], *, keep: bool = True) -> dict[str, torch.Tensor]:
    """Each parameter's whole value as a plain tensor in host memory (``keep``), one parameter at a
    time, so the device never holds a second copy of the stage's weights.

    Sharded DTensors are gathered, which is collective over their replicas: every replica calls
    this in the same order, and one that does not ``keep`` (any but replica 0 in a checkpoint)
    drops each gathered tensor at once and skips the parameters it holds whole.
    """
    out = {}
    for name, p in params:
        if hasattr(p, "full_tensor"):
            full = p.detach().full_tensor()
        elif keep:
            full = p.detach()
        else:
            continue
        if keep:
            out[name] = full.to("cpu", copy=True)
    return out
