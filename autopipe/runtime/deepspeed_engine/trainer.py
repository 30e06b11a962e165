"""DeepSpeed's engine, trained the way train.py trains the torch one.

``DeepSpeedTrainer`` has the torch ``Trainer``'s surface as the loop in train.py uses it: ``step``
returns the same ``StepStats``; ``env`` (ranks, ``close``), ``build`` (the layer sequence, the
cut), ``config``, ``step_count``, ``is_first`` / ``is_last``. Checkpoints are DeepSpeed's own
(``engine.save_checkpoint``, one tag ``step_N`` per save), through three functions with the torch
ones' signatures, which train.py picks with the engine:

    torch engine            DeepSpeed engine
    rt.save_checkpoint      ds_save_checkpoint     (the last step also writes the final weights)
    rt.resume               ds_resume
    rt.latest_checkpoint    ds_latest_checkpoint   (an older run's final weights)

``--export`` is ``rt.export_final`` on both engines: ``save_final`` writes each stage's weights.

The module itself (layers as LayerSpecs, tied tensors, the planned cut) is
``autopipe.runtime.deepspeed_engine.module``; the ds_config and the refusals are ``autopipe.runtime.deepspeed_engine.settings``.

What train.py runs for ``--engine deepspeed`` (under torchrun; gloo on a CPU)::

    trainer = DeepSpeedTrainer(source, "plan.json", config, args)
    data = JobData(source, args.data, seq_len=SEQ_LEN, seq=trainer.build.seq)
    stats = trainer.step(*data.batch(trainer.step_count, rows, inputs=trainer.is_first, target=trainer.is_last))
    ds_save_checkpoint(trainer, "checkpoints", keep=2, data=data.state())
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import AutopipeError
from ...planner.plan import load_plan
from ...planner.stage_plan import StagePlan, even_boundaries
from ..data.batches import batch_tokens, split_batch
from ..data.losses import model_loss
from ..logs.steps import StepStats
from ..stage.eval_mode import traced_eval_mode
from ..training.optim import TrainConfig, make_lr_scheduler, make_optimizer, optimizer_class
from .module import DSLayer, LayerSource, build_pipeline_module, save_final_weights
from .settings import ds_config, load_ds_config, refuse_flags, refuse_plan

__all__ = ["DSLayer", "DeepSpeedBuild", "DeepSpeedEnv", "DeepSpeedTrainer", "build_pipeline_module", "ds_config",
           "ds_latest_checkpoint", "ds_resume", "ds_save_checkpoint", "train_deepspeed"]

FINAL = "deepspeed_final"  # under --ckpt-dir: an older run's last weights as an autopipe checkpoint (rt.export reads it)


@dataclass(frozen=True)
class DeepSpeedEnv:
    """Where this process sits in DeepSpeed's grid (pipe x data), as train.py reads ``DistEnv``."""

    rank: int
    world: int
    dp_size: int
    pp_size: int
    dp_rank: int
    pp_rank: int  # DeepSpeed's stage id
    device: torch.device
    tp_size: int = 1  # DeepSpeed's PipelineModule runs no tensor parallelism here (--tp is refused)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def close(self) -> None:
        """Leave together: a rank exiting while DeepSpeed's comm threads still run aborts the process."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


@dataclass(frozen=True)
class DeepSpeedBuild:
    """What this rank holds, as train.py reads the torch engine's ``StageBuild``."""

    seq: Any  # the LayerSequence (meta, but for this stage's tensors)
    plan: StagePlan  # one chunk per stage; DeepSpeed runs its own 1F1B
    module: nn.Module  # the PipelineModule (this stage's layers)
    recompute: list[str] = field(default_factory=list)  # "none" per chunk: DeepSpeed recomputes nothing asked

    @property
    def layout(self) -> StagePlan:
        """``plan``, by the name train.py files written before StagePlan read it."""
        return self.plan


class DeepSpeedTrainer:
    """Trains this rank's stage of the plan on DeepSpeed's PipelineEngine.

    ``plan_path`` is a plan.json or "even"; ``config`` the job's training settings; ``args`` train.py's
    flags (``--dp``, ``--weights``, ``--deepspeed_config``, ``--check``, ``--batch-size``, and the ones
    refused here: ``--verify``, ``--recompute``, ``--zero`` 2/3, schedules other than 1F1B/GPipe).
    The ds_config is ``--deepspeed_config``, else the job's ds_config.json beside train.py.
    """

    def __init__(self, source: Any, plan_path: str, config: TrainConfig, args: Any) -> None:
        refuse_flags(args)
        plan = None if plan_path == "even" else load_plan(plan_path)
        refuse_plan(plan, plan_path, args)
        deepspeed = _import_deepspeed()
        import torch.distributed as dist

        from ..data.losses import make_loss
        from ..process.comm import Comm, checking_requested
        from ..process.distenv import rank_device
        from ..process.lifecycle import check_launch

        device = rank_device()
        if "WORLD_SIZE" not in os.environ:  # plain `python train.py`: a one-rank world
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
        if device.type != "cuda":
            skip_shm_comm_build(deepspeed)
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        world, dp = dist.get_world_size(), args.dp
        if dp < 1 or world % dp:
            raise AutopipeError(f"world size {world} is not a multiple of --dp {dp}; launch dp x stages processes.")
        pp = world // dp
        if plan is not None:
            check_launch(plan, pp, dp, plan_path=plan_path)
        layers = LayerSource(source.factory, source.args, source.kwargs, seed=config.seed,
                             weights=args.weights or source.weights, device=device, autocast=config.autocast_dtype)
        boundaries = even_boundaries(len(layers.seq.layers), pp) if plan is None else list(plan.boundaries)
        if len(boundaries) - 1 != pp:
            raise AutopipeError(
                f"DeepSpeed runs one chunk per stage but the plan has {len(boundaries) - 1} chunks for {pp} stages; "
                "make a plan without virtual stages for --engine deepspeed."
            )
        job_config = Path(sys.argv[0]).resolve().with_name("ds_config.json")
        cfg, config = load_ds_config(args.deepspeed_config or (str(job_config) if job_config.is_file() else None),
                                     config, args, dp)  # fmt: skip
        self.zero = int((cfg.get("zero_optimization") or {}).get("stage", 0))
        self.config = replace(config, zero=self.zero)  # the ds_config's stage is what runs
        self.loss_fn = _LossFn(layers.seq, make_loss(source.loss))
        module = build_pipeline_module(layers, boundaries, pp, self.loss_fn)
        self.layers = layers.built  # this stage's DSLayers: seeded and autocast per step
        for layer in self.layers:
            layer.autocast_dtype = config.autocast_dtype
        params = {n: p for n, p in module.named_parameters()}
        self.optimizer = make_optimizer(params, config, cls=_clipping(optimizer_class(config)))
        scheduler = make_lr_scheduler(self.optimizer, config)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=self.optimizer, lr_scheduler=scheduler, config=cfg)
        if self.zero == 0:  # the norm is taken (and logged) always; a clip of 0 only skips the scaling
            comm = Comm(device, checking=bool(getattr(args, "check", False)) or checking_requested())
            self.optimizer.clip = _make_clip(module, self.engine.grid.get_pipe_parallel_group(), config.grad_clip, comm)
        grid = self.engine.grid
        self.env = DeepSpeedEnv(rank=dist.get_rank(), world=world, dp_size=dp, pp_size=pp,
                                dp_rank=grid.get_data_parallel_rank(), pp_rank=grid.get_stage_id(), device=device)
        self.build = DeepSpeedBuild(layers.seq, StagePlan(tuple(boundaries)).placed(pp), module, ["none"] * pp)
        self.is_first, self.is_last = self.engine.is_first_stage(), self.engine.is_last_stage()
        self.step_count = 0

    def step(self, args: Any, kwargs: Any = None, target: torch.Tensor | None = None) -> StepStats:
        """Train on one batch (this replica's share), as ``Trainer.step``: DeepSpeed's ``train_batch``
        over the micro-batches, each layer seeded per micro-batch as on the torch engine."""
        from ..stage.build import MicrobatchSeeds

        mb = self.config.microbatches
        micro = self._micro_batches(args, kwargs, target)
        seeds = MicrobatchSeeds(self.config.seed, self.step_count, self.env.dp_rank * mb)
        for layer in self.layers:
            layer.seeds, layer.microbatch = seeds, 0
        lr = self.optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        loss = float(self.engine.train_batch(data_iter=iter(micro)))
        dt = time.perf_counter() - t0
        if self.zero == 0:
            norm = _norm_value(self.optimizer.last_norm)
        else:  # ZeRO 1: DeepSpeed clips, and reports the norm
            norm = float(self.engine.get_global_grad_norm() or float("nan"))
        self.step_count += 1
        tokens = batch_tokens(args, kwargs) * self.env.dp_size
        return StepStats(step=self.step_count, loss=loss, lr=lr, grad_norm=norm, step_time=dt,
                         tokens_per_s=tokens / dt if dt > 0 else 0.0, stage_times=[dt])

    def _micro_batches(self, args: Any, kwargs: Any, target: torch.Tensor | None) -> list[tuple[Any, torch.Tensor]]:
        """(packed inputs, target) per micro-batch, as DeepSpeed's data iterator yields them; a
        placeholder target where the model computes its own loss. Host tensors: DeepSpeed's engine
        copies each micro-batch to its device when it loads it."""
        mb, seq = self.config.microbatches, self.build.seq
        targets = list(target.chunk(mb)) if target is not None else [torch.zeros(1)] * mb
        return [(seq.pack_inputs(a, k), t) for (a, k), t in zip(split_batch(args, kwargs or {}, mb), targets)]

    def evaluate(self, args: Any, kwargs: Any = None, target: torch.Tensor | None = None,
                 labels: torch.Tensor | None = None) -> torch.Tensor:
        """Forward one batch for evaluation (DeepSpeed's ``eval_batch``), as ``Trainer.evaluate``:
        this rank's sums (loss over micro-batches, micro-batches, correct and labelled rows)."""
        micro = self._micro_batches(args, kwargs, labels if labels is not None else target)
        for layer in self.layers:
            layer.seeds, layer.microbatch = None, 0
        self.loss_fn.metrics, self.loss_fn.classify = [], labels is not None
        try:
            # the traced layers' dropout and batch-norm flags, which eval_batch's .eval() leaves on;
            # train mode after (eval_batch leaves the module in eval mode)
            with traced_eval_mode([self.engine.module]):
                self.engine.eval_batch(data_iter=iter(micro), bcast_loss=False)
            figures = self.loss_fn.metrics
        finally:
            self.loss_fn.metrics = None
        if not figures:
            return torch.zeros(4, dtype=torch.float64, device=self.env.device)
        return torch.stack(figures).sum(0).to(self.env.device)

    def save_final(self, folder: Path) -> None:
        """This stage's trained weights as an autopipe checkpoint folder (rank files + meta.json),
        which ``rt.export`` joins into one safetensors file. Collective."""
        env, seq = self.env, self.build.seq
        meta = {"step": self.step_count, "pp": env.pp_size, "dp": env.dp_size,
                "tied": {g.canonical: list(g.names) for g in seq.tied}}
        save_final_weights(self.build.module, folder, env.pp_rank, write=env.dp_rank == 0,
                           meta=meta if env.rank == 0 else None)
        env.barrier()


def _import_deepspeed() -> Any:
    os.environ.setdefault("LOCAL_RANK", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise AutopipeError("--engine deepspeed needs DeepSpeed: pip install deepspeed (or --engine torch).") from None
    _typed_receive_buffers(deepspeed)
    return deepspeed


def _typed_receive_buffers(deepspeed: Any) -> None:
    """Make DeepSpeed's pipeline engine reuse a receive buffer only for a tensor of its own dtype.

    Why: its engine keeps one list of receive buffers, by position, for the activations a stage
    receives and the gradients it receives back, and reuses a buffer of enough elements whatever
    its dtype. A middle stage of a traced Llama receives (ids int64, mask uint8, cos, sin, hidden)
    and gets gradients for (cos, sin, hidden): the second gradient landed in the mask's uint8 buffer,
    8192 bytes for a 32768-byte float tensor, and gloo aborted ("Received data size doesn't match
    expected size") on any Llama cut into 3 or more stages. A buffer of another dtype is replaced;
    the activations' buffers keep their own reference, so each is still allocated once.
    """
    engine = deepspeed.runtime.pipe.engine.PipelineEngine
    reuse = engine._allocate_or_extend_buffers
    if getattr(reuse, "autopipe_typed", False):
        return

    def allocate_or_extend(self: Any, idx: int, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        bufs = self._grad_layer_buf
        if idx < len(bufs) and bufs[idx].dtype != dtype:
            bufs[idx] = self._allocate_buffer(shape, dtype=dtype, num_buffers=1)[0]
            return bufs[idx]
        return reuse(self, idx, shape, dtype)

    allocate_or_extend.autopipe_typed = True  # type: ignore[attr-defined]
    engine._allocate_or_extend_buffers = allocate_or_extend


class _LossFn:
    """The last stage's loss: the model's own from its unpacked outputs, or the user's against the
    target. While ``metrics`` is a list (an evaluation), each micro-batch's figures go there too."""

    def __init__(self, seq: Any, user_loss: Any) -> None:
        self.seq, self.user_loss = seq, user_loss
        self.metrics: list[torch.Tensor] | None = None
        self.classify = False

    def __call__(self, outputs: Any, target: Any) -> torch.Tensor:
        from ..training.evaluate import eval_figures

        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        unpacked = self.seq.unpack_outputs(tuple(t.bool() if t.dtype == torch.uint8 else t for t in outs))
        loss = model_loss(unpacked) if self.user_loss is None else self.user_loss(unpacked, target)
        if self.metrics is not None:
            self.metrics.append(eval_figures(unpacked, loss, target if self.classify else None))
        return loss


_loss_fn = _LossFn


class _Clipping:
    """Mixed into the configured optimizer's class: take the global gradient norm and clip to it
    first, each tied tensor counted once.

    DeepSpeed's fp32 clipping (``runtime.utils.clip_grad_norm_``) sums the norm of a tied tensor on
    every stage holding it, so its clip differs from the unpipelined model's; we clip ourselves,
    once DeepSpeed has reduced the gradients, just before the update. ``last_norm`` keeps the norm
    (a device tensor) for the step log.
    """

    clip: Any = None
    last_norm: Any = None

    def step(self, closure: Any = None) -> Any:
        if self.clip is not None:
            self.last_norm = self.clip()
        return super().step(closure)  # type: ignore[misc]


_CLIPPING: dict[type, type] = {}


def _clipping(cls: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``cls`` with ``_Clipping``'s step, one class per optimizer class (``_ClippingAdamW`` for AdamW)."""
    if cls not in _CLIPPING:
        _CLIPPING[cls] = type(f"_Clipping{cls.__name__}", (_Clipping, cls), {})
    return _CLIPPING[cls]


_ClippingAdamW = _clipping(torch.optim.AdamW)


def _make_clip(module: nn.Module, pipe_group: Any, max_norm: float, comm: Any) -> Any:
    from ..training.grads import clip_grads_, global_grad_norm

    params = dict(module.named_parameters())
    replicated = {n for n, p in params.items() if getattr(p, "ds_pipe_replicated", False)}

    def clip() -> torch.Tensor:
        norm = global_grad_norm(params, replicated, pipe_group, comm)
        clip_grads_(list(params.values()), norm, max_norm)
        return norm

    return clip


def _norm_value(norm: Any) -> float:
    """The logged gradient norm (the optimizer's last; nan when no step has run)."""
    return float(norm) if norm is not None else float("nan")


def ds_save_checkpoint(trainer: DeepSpeedTrainer, root: str | os.PathLike[str], *, keep: int = 2,
                       data: dict[str, Any] | None = None) -> Path:
    """DeepSpeed's own checkpoint of this step under ``root/step_N`` (collective), the newest ``keep``
    of this run kept; a folder holding another run's checkpoints is refused first (``check_ckpt_dir``).
    The final weights for ``--export`` come from ``rt.export_final``, not from here."""
    from ..checkpoints.folders import check_ckpt_dir

    check_ckpt_dir(root)
    step = trainer.step_count
    _ds_save(trainer.engine, str(root), step, keep=keep, data=data or {}, rank=trainer.env.rank,
             steps=trainer.config.steps)  # fmt: skip
    return Path(root) / f"step_{step:08d}"


def ds_latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The final weights an older run wrote under ``root`` (``deepspeed_final``, what ``rt.export``
    reads), or None; today's train.py exports with ``rt.export_final`` instead."""
    final = Path(root) / FINAL
    return final if (final / "meta.json").is_file() else None


def ds_resume(trainer: DeepSpeedTrainer, ckpt_dir: str | os.PathLike[str], *, mode: str, steps: int,
              data: Any = None, say: Any = print) -> Path | None:
    """``--resume`` through DeepSpeed's ``load_checkpoint`` (``mode`` "must" or "auto"): the newest
    tag under ``ckpt_dir``, or None when ``mode`` is "auto" and there is none."""
    from ..checkpoints.resume import ResumeError
    from ..checkpoints.folders import claim_ckpt_dir

    root = Path(ckpt_dir)
    tags = _ds_tags(root)
    claim_ckpt_dir(root)  # this run continues what is there (or starts it afresh)
    if not tags:
        if mode == "auto":
            say(f"no checkpoint in {root}: starting at step 0 (--resume auto)")
            return None
        raise ResumeError(f"--resume: no DeepSpeed checkpoint in {root}; check --ckpt-dir, or use --resume auto to start afresh.")
    path, client = trainer.engine.load_checkpoint(str(root), tag=tags[-1].name)
    if path is None:
        raise ResumeError(f"{tags[-1]} could not be loaded by DeepSpeed; it was saved with another layout (stages, --dp).")
    trainer.step_count = step = int(client["step"])
    say(f"resumed from {tags[-1]} at step {step}")
    if client.get("steps") and int(client["steps"]) != steps:
        say(f"note: the checkpoint was trained for --steps {client['steps']}; the learning rate now decays over "
            f"{steps} steps from step {step}")
    if step >= steps:
        raise ResumeError(f"{tags[-1]} is at step {step}, already at --steps {steps}: pass a larger --steps to train on.")
    return tags[-1]


def train_deepspeed(source: Any, plan_path: str, config: TrainConfig, args: Any, *, seq_len: int) -> list[float]:
    """The whole DeepSpeed run in one call, for a train.py written before ``DeepSpeedTrainer``
    (today's train.py spells these steps out). Returns the per-step losses."""
    from ..checkpoints.exports import export_final
    from ..data.losses import loss_name
    from ..data.tasks import JobData
    from ..logs.steps import StepLogger

    trainer = DeepSpeedTrainer(source, plan_path, config, args)
    env, config = trainer.env, trainer.config
    data = JobData(source, args.data, seq_len=seq_len, seed=config.seed, seq=trainer.build.seq)
    log = StepLogger(env.rank, json_path=args.log_json, unit=data.unit)
    log.info(f"{source.name}: {len(trainer.build.seq.layers)} layers, stages {list(trainer.build.plan.boundaries)} on "
             f"DeepSpeed x {env.dp_size} replica(s), {config.microbatches} micro-batches, ZeRO {trainer.zero}, "
             f"loss {loss_name(source.loss)}, data {data.state()['source']}")
    if args.resume:
        ds_resume(trainer, args.ckpt_dir, mode=args.resume, steps=config.steps, say=log.info)
    rows = args.batch_size * config.microbatches * env.dp_size
    losses = []
    for step in range(trainer.step_count, config.steps):
        stats = trainer.step(*data.batch(step, rows, replica=env.dp_rank, replicas=env.dp_size,
                                         inputs=trainer.is_first, target=trainer.is_last))
        losses.append(stats.loss)
        log.step(stats)
        if (args.ckpt_every and stats.step % args.ckpt_every == 0) or stats.step == config.steps:
            ds_save_checkpoint(trainer, args.ckpt_dir, keep=args.ckpt_keep, data=data.state())
    if args.export:
        exported = export_final(trainer, args.export, model_fn=source.factory)
        log.info(f"exported {exported}")
    env.close()
    return losses


def _ds_tags(root: Path) -> list[Path]:
    import re

    found = [p for p in root.iterdir() if p.is_dir() and re.fullmatch(r"step_\d{8}", p.name)] if root.is_dir() else []
    return sorted(found)


def _ds_save(engine: Any, root: str, step: int, *, keep: int, data: dict[str, Any], rank: int, steps: int = 0) -> None:
    """DeepSpeed's own checkpoint of this step (collective), tagged ``step_N``; the newest ``keep`` kept."""
    import shutil

    engine.save_checkpoint(root, tag=f"step_{step:08d}", client_state={"step": step, "steps": steps, "data": data})
    if rank == 0 and keep > 0:
        for stale in _ds_tags(Path(root))[:-keep]:
            shutil.rmtree(stale, ignore_errors=True)


def skip_shm_comm_build(deepspeed: Any) -> None:
    """Keep DeepSpeed's CPU backend from compiling its shared-memory all-reduce at init.

    DeepSpeed compiles ``deepspeed_shm_comm`` (the all-reduce its inference engine calls) in every
    process's first ``init_distributed`` on a CPU. That build is not cached across compiler flags:
    about 70 s on 2 cores (a CI run's first DeepSpeed test took 79 s, 3 s otherwise). A training job
    here talks over gloo and never calls the op. So it is marked incompatible in DeepSpeed's table of
    buildable ops, ``deepspeed.ops.__compatible_ops__``. That table is one mutable dict by design ("edits
    to it persist"). Its torch backend then skips the build and runs every collective on gloo, as it
    does where the op cannot build.
    """
    table = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(table, dict):
        table["deepspeed_shm_comm"] = False
