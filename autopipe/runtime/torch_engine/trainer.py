"""One optimizer step of a pipelined model, and the state a checkpoint needs to continue it exactly.

A step: the batch is copied to the rank's device -> the schedule runs every micro-batch forward and
backward, and after each stage's last backward its data-parallel engine reduces the gradients
over the replicas (mean; ``autopipe.runtime.torch_engine.zero``) and the stage divides them by the micro-batch
count -> fp16 gradients unscaled -> tied gradients summed over their holders -> global gradient
norm -> the step's one host read (loss, norm, times, gathered from every rank) -> norm clipped ->
AdamW (its state sharded under ZeRO 1-3) -> learning-rate schedule.

Everything before the host read stays on the device, so on a GPU the host queues the whole step
without waiting; the read is where it waits once, and where rank 0 gets what it logs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import AutopipeError
from ..data.batches import batch_tokens, pack_batch
from ..logs.steps import StepStats
from ..process.distenv import DistEnv
from ..stage.build import MicrobatchSeeds, StageBuild, local
from ..stage.expert_parallel import as_global, reduce_expert_grads_
from ..stage.tensor_parallel import reduce_partial_grads_
from ..training.optim import LossScaler, TrainConfig, lr_factor, make_lr_scheduler, preallocate_
from ..training.grads import clip_grads_, global_grad_norm, sync_tied_grads, zero_grads_
from .pipeline import PipelineEngine, Stopwatch
from .zero import (
    explain_ddp_error,
    full_values,
    is_zero_one,
    make_dp_optimizer,
    optimizer_state,
    shard_chunks_,
    sharded_grads,
)

__all__ = ["Trainer"]


@dataclass
class _Pending:
    """The step in flight between ``forward_backward``, ``clip_gradients`` and ``optimizer_step``."""

    started: float  # perf_counter at forward_backward
    tokens: int  # the whole world's tokens (or samples) in this step
    loss: torch.Tensor | None = None  # this rank's loss share on the device (last stage only)
    stats: dict[str, Any] | None = None  # the host read clip_gradients made


class Trainer:
    """Trains this rank's chunks as part of the whole pipeline.

    Example (one process running every stage; under torchrun each rank runs the same lines):
        >>> from autopipe.runtime import build_reference, build_stage, init_dist, make_loss
        >>> def make_model():
        ...     return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> x, y = torch.randn(8, 8), torch.randn(8, 1)
        >>> env = init_dist(dp=1)
        >>> build = build_stage(make_model, (x[:2],), {}, [0, 2, 3], pp_rank=env.pp_rank, pp_size=env.pp_size)
        >>> trainer = Trainer(build, env, TrainConfig(steps=10, microbatches=4), loss_fn=make_loss("mse"))
        >>> stats = trainer.step((x,), {}, y)
        >>> expected = torch.nn.functional.mse_loss(build_reference(make_model, seed=0)(x), y).item()
        >>> stats.step, abs(stats.loss - expected) < 1e-6  # the first step's loss is the whole model's
        (1, True)
        >>> env.close()
    """

    def __init__(
        self,
        build: StageBuild,
        env: DistEnv,
        config: TrainConfig,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> None:
        if build.plan.pp_size != env.pp_size:
            raise AutopipeError(
                f"the stage was built for {build.plan.pp_size} pipeline ranks but the world has "
                f"{env.pp_size} (world {env.world} / dp {env.dp_size}); launch with "
                f"--nproc-per-node {build.plan.pp_size * env.dp_size}."
            )
        self.build = build
        self.env = env
        self.config = config
        self.scaler = LossScaler(config.dtype == "fp16", config.loss_scale)
        # data parallelism wraps the chunks the stages run (one replica: nothing to wrap)
        wrap = None
        tp = getattr(env, "tp_size", 1)
        if tp > 1:
            check_tp_composes(config, env.dp_size, build)
        ep = build.ep_layout
        # expert slices are each held by their own ranks: the dp engine leaves them to reduce_expert_grads_
        own_experts = {id(build.params[n]) for n in ep.expert_params} if ep is not None else set()
        if env.dp_size > 1:
            dp_mesh = env.mesh["dp"]

            gathered = torch.bfloat16 if config.dtype == "bf16" else None  # FSDP2 gathers bf16 weights

            def wrap(chunks: list[Any], schedule: str) -> list[Any]:
                return shard_chunks_(build, chunks, dp_mesh, config.zero, schedule=schedule, param_dtype=gathered,
                                     tp=tp, ignored=own_experts)
        self.engine = PipelineEngine(
            build,
            pp_group=env.pp_group,
            device=env.device,
            microbatches=config.microbatches,
            loss_fn=loss_fn,
            autocast_dtype=config.autocast_dtype,
            loss_scale=lambda: self.scaler.scale,
            comm=env.comm,
            wrap=wrap,
        )
        env.make_tied_groups(build.tied)
        self.params = build.params  # the engine's parameters (DTensors under replicate and FSDP2, plain under DDP)
        # the norm sums squares over the pipeline (and its tp ranks); over the replicas too when each
        # holds a shard
        self._norm_group = None if sharded_grads(config.zero, env.dp_size) else \
            (env.pp_ep_group if ep is not None else env.pp_tp_group if tp > 1 else env.pp_group)
        # a tied tensor's norm is counted by its first holder only
        self._counted_elsewhere = {
            t.name for t in build.tied_here() if t.holders[0] != env.pp_rank and t.name in self.params
        }
        if tp > 1 and env.tp_rank != 0:  # what every tp rank holds whole is counted by tp rank 0 only
            from ..stage.tensor_parallel import replicated_over_tp

            self._counted_elsewhere |= replicated_over_tp(self.params)
        if ep is not None and self._norm_group is not None and env.ep_rank != 0:
            # what every rank of an ep group holds alike (ZeRO 0): counted by its rank 0
            self._counted_elsewhere |= set(self.params) - ep.expert_params
        if ep is not None and self._norm_group is None and env.dp_rank >= ep.ep:
            # ZeRO 2/3: the norm sums over the world, each replica's shards its own; an expert slice is
            # the same in every ep group (reduce_expert_grads_): counted in the first ep group only
            self._counted_elsewhere |= ep.expert_params
        self.optimizer = make_dp_optimizer(self.params, config, zero=config.zero, dp_size=env.dp_size,
                                           group=env.dp_group, experts=sorted(ep.expert_params) if ep else (),
                                           expert_group=env.expert_dp_group)  # fmt: skip
        # gradients and state once, before any activation (see preallocate_)
        if is_zero_one(self.optimizer):
            for p in self.params.values():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.optimizer.preallocate_()
        else:
            preallocate_(self.optimizer)
        self.scheduler = make_lr_scheduler(self.optimizer, config)
        self.step_count = 0
        self._pending: _Pending | None = None  # the step between its phases
        self._run_clock = Stopwatch(env.device)
        env.peak.rebase(_held_bytes(build, self.optimizer))

    def step(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, target: torch.Tensor | None = None
    ) -> StepStats:
        """Train on one batch (this replica's share): the model's own arguments, plus a target when
        a user loss_fn needs one. Every rank calls it with the same batch (only the first and last
        chunks read it); host tensors are copied to the rank's device here.

        The three phases, each callable on its own from a training loop of your own:
        ``forward_backward``, ``clip_gradients``, ``optimizer_step``.
        """
        self.forward_backward(args, kwargs, target)
        self.clip_gradients()
        return self.optimizer_step()

    def forward_backward(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, target: torch.Tensor | None = None
    ) -> None:
        """The schedule: every micro-batch of this replica's share forward and backward through the
        pipeline. After each stage's last backward its gradients are the micro-batches' mean,
        reduced over the replicas. Nothing is read back to the host."""
        env = self.env
        self._pending = _Pending(time.perf_counter(), batch_tokens(args, kwargs) * env.dp_size)
        env.peak.reset()
        with env.comm.step():
            self._run_clock.reset()
            self._run_clock.start()
            inputs = None
            if self.engine.is_first:
                packed = pack_batch(self.build.seq, args, dict(kwargs or {}), self.config.microbatches)
                inputs = env.to_device(packed)
            try:
                loss = self.engine.run(inputs, env.to_device(target) if self.engine.is_last else None, self.seeds())
            except RuntimeError as e:
                explained = explain_ddp_error(e, self.config.zero)
                if explained is e:
                    raise
                raise explained from None
            self._run_clock.stop()
        self._pending.loss = loss

    def clip_gradients(self) -> float:
        """Tied gradients summed over the stages holding a copy, fp16's loss scale taken out, the
        global gradient norm (every stage, each tied tensor once), then the step's one host read
        (loss, norm, times, gathered from every rank) and the clip to ``config.grad_clip``.
        Returns the norm; inf or nan is an fp16 overflow, and ``optimizer_step`` then skips."""
        pending = self._pending_for("clip_gradients", after="forward_backward")
        env, comm = self.env, self.env.comm
        with comm.step():
            params = list(self.params.values())
            self.settle_gradients()
            norm = global_grad_norm(self.params, self._counted_elsewhere, self._norm_group, comm)
            pending.stats = self._gather(pending.loss, norm)
            # an inf/nan anywhere makes the global norm inf/nan: fp16 then skips the update
            if pending.stats["finite"]:
                clip_grads_(params, norm, self.config.grad_clip)
        return float(pending.stats["grad_norm"])

    def settle_gradients(self) -> None:
        """After the schedule, every gradient this rank holds as the untouched model's on the global
        batch (``--verify`` compares them here): sequence parallelism's partial parts summed, alias
        leaves folded, fp16's loss scale taken out, expert slices summed over their expert
        data-parallel group, tied copies summed over the stages holding them. Collective."""
        env, comm = self.env, self.env.comm
        if self.build.tp_layout is not None and self.build.tp_layout.sequence_parallel:
            # norms met sequence-sharded tokens: their replicated weights hold one part per tp rank
            reduce_partial_grads_(self.build.chunks)
        self.build.fold_alias_grads_()  # before unscaling: alias leaves hold scaled gradients too
        if self.scaler.enabled:
            for p in self.params.values():
                if p.grad is not None:
                    local(p.grad).div_(self.scaler.scale)
        if self.build.ep_layout is not None:
            reduce_expert_grads_(self.params, self.build.ep_layout.expert_params, env.expert_dp_group,
                                 env.dp_size, comm)
        sync_tied_grads(self.params, self.build.tied_here(), env.tied_groups, comm)

    def zero_gradients(self) -> None:
        """Every gradient zeroed in place, kept allocated (see preallocate_): the engine's parameters'
        own, not through the optimizer (torch's zero_grad refuses expert parallelism's mix of plain
        slices and DTensors, and ZeRO 1's plain leaves link a DTensor's gradient only at its step, so
        after --verify's step without one they held the gradient before)."""
        zero_grads_(self.params.values())

    def optimizer_step(self) -> StepStats:
        """The optimizer's update (skipped after an fp16 overflow) and the LR schedule's step; the
        gradients are zeroed, kept allocated. Returns what the whole step did."""
        pending = self._pending_for("optimizer_step", after="clip_gradients")
        stats, finite = pending.stats, pending.stats["finite"]
        lr = self.optimizer.param_groups[0]["lr"]
        if finite:
            self.optimizer.step()
            self.build.sync_alias_params_()
            self.scheduler.step()  # a step fp16 skipped for overflow is no step of the LR schedule
        self.scaler.update(finite)
        self.zero_gradients()
        self.step_count += 1
        self._pending = None
        total = time.perf_counter() - pending.started
        first = self.env.pipeline_ranks(0)  # replica 0's stages, whichever way the placement numbers them
        return StepStats(
            step=self.step_count,
            loss=stats["loss"],
            lr=lr,
            grad_norm=stats["grad_norm"],
            step_time=max(stats["step_times"]),
            tokens_per_s=pending.tokens / total if total > 0 else 0.0,
            stage_times=[stats["step_times"][r] for r in first],
            forward_times=[stats["forward_times"][r] for r in first],
            skipped=not finite,
            loss_scale=self.scaler.scale,
            peak_memory=[stats["peak_memory"][r] for r in first],
            memory_exact=self.env.peak.exact,
            whole_step_time=total,  # what the plan's predicted step predicts (Plan.predicted_step)
        )

    def _pending_for(self, phase: str, *, after: str) -> _Pending:
        """The step in flight, once the phase before ``phase`` has run (else one line saying the order)."""
        pending = self._pending
        if pending is None or (after == "clip_gradients" and pending.stats is None):
            raise AutopipeError(f"trainer.{phase}() runs after trainer.{after}() in each step: forward_backward, "
                                "clip_gradients, optimizer_step (or trainer.step, which runs the three).")
        return pending

    def evaluate(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, target: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None) -> torch.Tensor:
        """Forward one batch (this replica's share) for evaluation: no gradient, no update, dropout
        off. Returns this rank's sums on the device (``PipelineEngine.evaluate``): loss over
        micro-batches, micro-batches, correct and labelled rows (``labels``: each row's class id)."""
        env = self.env
        inputs = None
        if self.engine.is_first:
            inputs = env.to_device(pack_batch(self.build.seq, args, dict(kwargs or {}), self.config.microbatches))
        from ..training.evaluate import eval_figures

        wanted = labels if labels is not None else target
        return self.engine.evaluate(inputs, env.to_device(wanted) if self.engine.is_last else None,
                                    figures=eval_figures, classify=labels is not None)

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first chunk (it reads the batch's inputs)."""
        return self.engine.is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last chunk (it reads the targets and computes the loss)."""
        return self.engine.is_last

    def seeds(self) -> MicrobatchSeeds:
        """This step's per-layer, per-micro-batch RNG seeds (see ``MicrobatchSeeds``)."""
        return MicrobatchSeeds(self.config.seed, self.step_count, self.env.dp_rank * self.config.microbatches)

    def _gather(self, loss: torch.Tensor | None, norm: torch.Tensor) -> dict[str, Any]:
        """The step's one host read: every rank's (loss share, norm, pipeline time, forward time,
        peak memory so far in the step).

        One all-gather carries everything rank 0 logs; only last-stage ranks hold a loss. On a GPU
        the device is synchronised first and the times come from CUDA events, so they are the
        device's, not the time the host took to queue the work.
        """
        env, comm = self.env, self.env.comm
        with comm.host_read():
            comm.synchronize()
            mine = torch.zeros(5, dtype=torch.float64, device=env.device)
            if loss is not None and getattr(env, "tp_rank", 0) == 0:  # every tp rank holds the same loss
                mine[0] = loss.double() / env.dp_size
            mine[1] = norm
            mine[2] = self._run_clock.total()
            mine[3] = self.engine.forward_time
            # the peak so far, with the previous step's optimizer step (runtime.peak): this step's comes
            # after the read and is reported with the next step
            mine[4] = env.peak.read()
            rows = comm.all_gather(mine, where="step statistics").tolist()
        return {
            "loss": sum(r[0] for r in rows),
            "grad_norm": rows[env.rank][1],  # equal on every rank (summed over the pipeline)
            "finite": all(math.isfinite(r[1]) for r in rows),
            "step_times": [r[2] for r in rows],
            "forward_times": [r[3] for r in rows],
            "peak_memory": [int(r[4]) for r in rows],
        }

    # --- checkpoint state -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's file of a checkpoint: step, LR schedule, loss scale, RNG, layout. The weights
        and optimizer state are ``tensor_state`` (saved once, sharded), not repeated here."""
        return {
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "step": self.step_count,
            "rng": torch.get_rng_state(),
            # this rank's own device generator (a GPU rank sees one GPU, or others it does not use)
            "device_rng": _device_rng_state(self.env.device),
            "chunks": self.build.chunk_ids,
            "boundaries": list(self.build.plan.boundaries),
            "config": self.config.to_dict(),
        }

    def save_final(self, folder: Path) -> None:
        """This stage's trained weights, whole, as ``folder/rank{stage}.pt`` (+ meta.json from rank
        0): what ``export`` joins into one safetensors file. Collective over the replicas (sharded
        parameters are gathered, into host memory one tensor at a time); replica 0 writes."""
        from ..checkpoints.exports import write_stage_weights

        env = self.env
        first = env.dp_rank == 0 and getattr(env, "tp_rank", 0) == 0  # tp ranks gather the same whole tensors
        # expert slices are gathered over their ep group (collective there, as sharded DTensors are)
        params = full_values(((n, self._whole(n, p.detach())) for n, p in self.params.items()), keep=first)
        if first:
            meta = {"step": self.step_count, "pp": env.pp_size, "dp": 1,
                    "tied": {t.name: list(t.names) for t in self.build.tied}} if env.rank == 0 else None
            write_stage_weights(Path(folder), env.pp_rank, params, meta)
        env.barrier()

    def tensor_state(self) -> dict[str, torch.Tensor]:
        """Parameters and AdamW state by parameter name, as this rank holds them (sharded DTensors,
        replicated DTensors, this replica's share under ZeRO 1, expert slices as views of their whole
        tensors, or plain tensors): what torch.distributed.checkpoint saves, and loads back in place,
        resharding to any replica count."""
        out: dict[str, torch.Tensor] = {f"param/{n}": self._whole(n, p.detach()) for n, p in self.params.items()}
        for name, state in optimizer_state(self.optimizer, self.params).items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{name}/{key}"] = self._whole(name, value)
        return out

    def _whole(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (parameter ``name``'s value or one of its optimizer states), or under expert
        parallelism, where it is an expert slice, a view of the whole expert tensor sharded over the
        ep group (autopipe.runtime.stage.expert_parallel.as_global)."""
        ep = self.build.ep_layout
        return tensor if ep is None else as_global(ep, name, tensor, self.env.device.type)

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """The rank file's state (``tensor_state`` is loaded apart, by ``load_checkpoint``)."""
        if list(state["boundaries"]) != list(self.build.plan.boundaries) or list(state["chunks"]) != self.build.chunk_ids:
            raise AutopipeError(
                f"the checkpoint holds chunks {state['chunks']} of boundaries {state['boundaries']} but "
                f"this rank runs chunks {self.build.chunk_ids} of {list(self.build.plan.boundaries)}; "
                "resume with the plan and pipeline stage count it was saved with, or export and reload it."
            )
        self.scheduler.load_state_dict(state["scheduler"])
        # the optimizer's own state dict is not loaded (its tensors come from tensor_state), so the
        # scheduled LR, which the scheduler writes into the groups only when it steps, is set here:
        # this run's (its --lr, its --steps), at the step the checkpoint reached
        self.scheduler.base_lrs = [self.config.lr for _ in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = self.config.lr
            group["lr"] = self.config.lr * lr_factor(self.scheduler.last_epoch, self.config)
        self.scaler.load_state_dict(state["scaler"])
        self.step_count = int(state["step"])
        # generator states are host tensors, whatever device a loader put them on
        torch.set_rng_state(state["rng"].cpu())
        device = self.env.device
        saved = state.get("device_rng")
        if saved is None and state.get("cuda_rng") and device.type == "cuda":  # checkpoints before device_rng
            saved = state["cuda_rng"][min(device.index or 0, len(state["cuda_rng"]) - 1)]
        if saved is not None and device.type == "cuda":
            torch.cuda.set_rng_state(saved.cpu(), device)


def check_tp_composes(config: TrainConfig, dp_size: int, build: StageBuild) -> None:
    """One line for what tensor parallelism does not compose with here: nothing of the data-parallel
    engines since ZeRO 1 steps tp shards through their local tensors (zero_one.ZeroOneAdamW)."""


def _device_rng_state(device: torch.device) -> torch.Tensor | None:
    """The generator state of ``device`` when it has one of its own (a GPU), as a host tensor."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _held_bytes(build: StageBuild, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors this rank holds once built: parameters, buffers, gradients and optimizer
    state, each storage once."""
    tensors = [t for chunk in build.chunks for t in (*chunk.parameters(), *chunk.buffers())]
    tensors += [p.grad for p in build.params.values() if p.grad is not None]
    # all of it, or ZeRO 1's share (and under ep its expert optimizer's)
    states = optimizer_state(optimizer, build.params).values()
    tensors += [v for state in states for v in state.values() if isinstance(v, torch.Tensor)]
    tensors = [local(t.detach()) for t in tensors]
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.device.type != "meta"}
    return sum(seen.values())


