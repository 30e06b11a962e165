"""DeepSpeed engine: the flattened layers as a ``PipelineModule`` cut exactly where the plan cuts.

The layer format is already DeepSpeed's (a Tensor or tuple of Tensors in and out), so each layer
becomes a ``LayerSpec``. Tied tensors become ``TiedLayerSpec`` entries: a small holder module owns
the tied weight (so DeepSpeed all-reduces its gradient between the stages holding it) and its
forward appends the weight to the activations; the layer right after it takes the weight from
there. The holder always sits on its layer's stage, so the weight never crosses a cut.

DeepSpeed's ``partition_method`` knows only uniform / parameters / type:regex, none of which
reproduces a plan, so ``PlannedPipelineModule`` takes the boundaries explicitly.

Each rank builds only its stage: DeepSpeed calls ``LayerSpec.build`` for the local layers only, and
our specs materialise their tensors from the meta model on demand (same seeded init as the torch
path, so both engines start from the same weights).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import AutopipeError
from ..graph.sequence import retarget_device_
from .build import fill_tensors, meta_model, to_meta
from .engine import model_loss, split_batch
from .layout import even_boundaries, load_plan
from .optim import TrainConfig, make_lr_scheduler, make_optimizer

__all__ = ["build_pipeline_module", "ds_config", "train_deepspeed"]


class _Context:
    """The meta model and its flattened layers, materialised piece by piece as specs are built."""

    def __init__(self, model_fn: Any, example_args: Sequence[Any], example_kwargs: dict[str, Any], *, seed: int,
                 weights: str | None, device: torch.device) -> None:
        from ..graph.flattener import flatten

        self.model_fn = model_fn
        self.model = meta_model(model_fn)
        self.seq = flatten(self.model, to_meta(tuple(example_args)), to_meta(dict(example_kwargs)), validate=False)
        self.seed, self.weights, self.device = seed, weights, device
        self.built: list[DSLayer] = []

    def materialize(self, names: Sequence[str]) -> None:
        fill_tensors(self.model, self.model_fn, list(names), seed=self.seed, weights=self.weights, device=self.device)
        self.seq.rebind_(self.model)
        for layer in self.built:  # rebind_ re-registers the tied tensors the built layers gave away
            layer.detach_tied()

    def tied_of(self, index: int) -> list[str]:
        return [g.canonical for g in self.seq.tied if index in g.layers]


class TiedHolder(nn.Module):
    """Owns one tied tensor on a stage (DeepSpeed syncs ``.weight`` between its holders)."""

    def __init__(self, ctx: _Context, name: str) -> None:
        super().__init__()
        ctx.materialize([name])
        self.tied_name = name
        self.weight = ctx.model.get_parameter(name)


def _append_weight(holder: TiedHolder, x: Any) -> tuple[torch.Tensor, ...]:
    xs = x if isinstance(x, tuple) else (x,)
    return (*xs, holder.weight)


class DSLayer(nn.Module):
    """Layer ``index`` of the sequence, taking its tied weights from the end of its input tuple.

    Booleans cross cuts as uint8 (DeepSpeed's p2p casts only a trailing mask; gloo sends no bool);
    the layer's recorded input signature says which inputs to turn back into bool.
    """

    def __init__(self, ctx: _Context, index: int) -> None:
        super().__init__()
        layer = ctx.seq.layers[index]
        names = [n for n, _ in layer.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in layer.named_buffers(remove_duplicate=False)]
        ctx.materialize(names)
        retarget_device_(layer, ctx.device)
        self.ctx, self.index, self.layer = ctx, index, layer
        self.num_tied = len(ctx.tied_of(index))
        self.slots: list[tuple[nn.Module, str]] = []
        self.detach_tied()
        ctx.built.append(self)
        self.bool_inputs = {i for i, sig in enumerate(ctx.seq.infos[index].inputs) if sig.dtype == "bool"}
        self.seeds: Any = None  # MicrobatchSeeds of the step, set by train_deepspeed
        self.microbatch = 0
        self.autocast_dtype: torch.dtype | None = None  # --dtype bf16: autocast over fp32 weights

    def detach_tied(self) -> None:
        """Remove the tied tensors from the layer's parameters (the TiedHolder owns them); remember
        where they sat, in the order their holders append them (sorted names)."""
        tied = sorted(self.ctx.tied_of(self.index))
        order = {id(self.ctx.model.get_parameter(n)): i for i, n in enumerate(tied)}
        found: list[tuple[int, nn.Module, str]] = []
        for mod in self.layer.modules():
            for attr, p in list(mod._parameters.items()):
                if p is not None and id(p) in order:
                    del mod._parameters[attr]
                    found.append((order[id(p)], mod, attr))
        if found:
            self.slots = [(m, a) for _, m, a in sorted(found, key=lambda t: t[0])]

    def forward(self, x: Any) -> Any:
        xs = list(x) if isinstance(x, tuple) else [x]
        weights = xs[len(xs) - self.num_tied :] if self.num_tied else []
        xs = xs[: len(xs) - self.num_tied]
        for (mod, attr), w in zip(self.slots, _expand(weights, self.slots)):
            mod.__dict__[attr] = w
        xs = [t.bool() if i in self.bool_inputs else t for i, t in enumerate(xs)]
        if self.seeds is not None:  # the torch engine's per-layer, per-micro-batch seeds (MicrobatchSeeds)
            torch.manual_seed(self.seeds.layer_seed(self.microbatch, self.index))
            self.microbatch += 1
        device_type = xs[0].device.type if xs else "cpu"
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None):
            out = self.layer(xs[0] if len(xs) == 1 else tuple(xs))
        outs = out if isinstance(out, tuple) else (out,)
        outs = tuple(t.to(torch.uint8) if t.dtype == torch.bool else t for t in outs)
        if torch.is_grad_enabled():
            # DeepSpeed backpropagates through every floating output a stage sends (Llama's rotary
            # cos/sin need no gradient and failed "element 0 of tensors does not require grad"); as
            # leaves they take the gradient the next stage sends back, which goes nowhere
            outs = tuple(t.detach().requires_grad_() if t.is_floating_point() and not t.requires_grad else t for t in outs)
        return outs[0] if len(outs) == 1 else outs


def _expand(weights: list[torch.Tensor], slots: list[tuple[nn.Module, str]]) -> list[torch.Tensor]:
    """One weight per tied tensor, repeated for each slot (a tensor may sit in several modules)."""
    if len(weights) == len(slots):
        return weights
    if len(weights) == 1:
        return weights * len(slots)
    raise AutopipeError("a layer holds several tied tensors in several places; DeepSpeed export needs one slot each.")


def _pipeline_module_class() -> type:
    from deepspeed.pipe import PipelineModule

    class PlannedPipelineModule(PipelineModule):
        """PipelineModule whose stage boundaries are given, not computed."""

        def __init__(self, layers: list[Any], parts: list[int], **kwargs: Any) -> None:
            self._planned_parts = list(parts)
            super().__init__(layers, partition_method="uniform", **kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(self._planned_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return PlannedPipelineModule


def _save_final(module: nn.Module, folder: Path, stage: int, *, write: bool, meta: dict[str, Any] | None = None) -> None:
    """This stage's trained parameters under their names in the original model, as an autopipe
    checkpoint folder (``rank{stage}.pt`` + ``meta.json``) that ``export`` joins into one
    safetensors file. ``write``: only the first data-parallel replica's ranks write (replicas hold
    the same weights)."""
    params: dict[str, torch.Tensor] = {}
    for child in module.modules():
        if isinstance(child, DSLayer):
            for name, p in child.layer.named_parameters():
                params[name] = p.detach().clone()
    for holder in getattr(module, "tied_modules", {}).values():
        params[holder.tied_name] = holder.weight.detach().clone()
    if not write:
        return
    folder.mkdir(parents=True, exist_ok=True)
    part = folder / f"rank{stage:05d}.pt.part"
    torch.save({"params": params}, part)
    os.replace(part, folder / f"rank{stage:05d}.pt")
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta, indent=2))


def build_pipeline_module(ctx: _Context, boundaries: Sequence[int], num_stages: int, loss_fn: Any) -> nn.Module:
    """LayerSpecs over the flattened layers (TiedLayerSpecs before layers using a tied tensor),
    partitioned at ``boundaries`` (layer indices, mapped onto the expanded spec list)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs: list[Any] = []
    starts: list[int] = []
    for i in range(len(ctx.seq.layers)):
        starts.append(len(specs))
        for name in sorted(ctx.tied_of(i)):
            # ModuleDict keys may not hold dots
            specs.append(TiedLayerSpec(name.replace(".", "__"), TiedHolder, ctx, name, forward_fn=_append_weight, tied_weight_attr=["weight"]))
        specs.append(LayerSpec(DSLayer, ctx, i))
    starts.append(len(specs))
    parts = [starts[b] for b in boundaries]
    return _pipeline_module_class()(specs, parts, num_stages=num_stages, loss_fn=loss_fn)


class _ClippingAdamW(torch.optim.AdamW):
    """AdamW that takes the global gradient norm and clips to it first, each tied tensor counted once.

    DeepSpeed's fp32 clipping (``runtime.utils.clip_grad_norm_``) sums the norm of a tied tensor on
    every stage holding it, so its clip differs from the unpipelined model's; we clip ourselves,
    once DeepSpeed has reduced the gradients, just before the update. ``last_norm`` keeps the norm
    (a device tensor) for the step log.
    """

    clip: Any = None
    last_norm: Any = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.clip is not None:
            self.last_norm = self.clip()
        return super().step(closure)


def _make_clip(module: nn.Module, pipe_group: Any, max_norm: float, comm: Any) -> Any:
    from .grads import clip_grads_, global_grad_norm

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


def ds_config(config: TrainConfig, *, rows: int, dp: int) -> dict[str, Any]:
    """The job's ds_config.json: batch sizes, precision, clipping, the optimizer, ZeRO.

    autopipe builds the optimizer and the LR schedule itself from the ``optimizer`` section (AdamW,
    decay on matrices only, warmup + cosine: the torch engine's, so both engines train the same
    numbers) and clips with ``gradient_clipping`` counting each tied tensor once (DeepSpeed's fp32
    clip counts it once per stage holding it). ZeRO stage 0 keeps that parity; stage 1 (what
    DeepSpeed allows with pipelines) shards the optimizer state over replicas, and then DeepSpeed
    clips and reports the norm itself.
    """
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": config.microbatches,
        "train_batch_size": rows * config.microbatches * dp,
        "gradient_clipping": config.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": config.lr, "betas": list(config.betas), "eps": config.eps,
                       "weight_decay": config.weight_decay},
        },
        "zero_optimization": {"stage": config.zero},  # the plan's (convert refuses 2/3 for DeepSpeed)
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif config.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 16}
    return cfg


def _load_ds_config(path: str | None, config: TrainConfig, args: Any, dp: int) -> tuple[dict[str, Any], TrainConfig]:
    """The ds_config to run with: ``--deepspeed_config``, else the job's ds_config.json, else made
    from the flags. The flags (batch size, micro-batches, lr, clip) override what the file says, as
    they do for the torch engine; the file's optimizer settings and ZeRO stage are kept."""
    from dataclasses import replace

    cfg = ds_config(config, rows=args.batch_size, dp=dp)
    if path is not None:
        try:
            user = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise AutopipeError(f"{path} is not a readable ds_config.json ({e}).") from None
        cfg.update({k: v for k, v in user.items() if k not in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")})
        params = (user.get("optimizer") or {}).get("params", {})
        if (user.get("optimizer") or {}).get("type", "AdamW").lower() not in ("adamw", "adam"):
            raise AutopipeError(f"{path}: optimizer {user['optimizer'].get('type')!r}; the pipeline engines train with AdamW.")
        config = replace(config, betas=tuple(params.get("betas", config.betas)), eps=float(params.get("eps", config.eps)),
                         weight_decay=float(params.get("weight_decay", config.weight_decay)))
    # precision is autocast over fp32 weights, as on the torch engine: the traced layers carry the
    # dtypes of the trace (a norm's upcast and cast back), which DeepSpeed's own bf16/fp16 modes, casting
    # the weights, break ("expected m1 and m2 to have the same dtype")
    wanted = "bf16" if (cfg.get("bf16") or {}).get("enabled") else "fp16" if (cfg.get("fp16") or {}).get("enabled") else "fp32"
    if path is not None and wanted != config.dtype:
        raise AutopipeError(f"{path} trains in {wanted} but --dtype is {config.dtype}; make them agree.")
    if config.dtype == "fp16":
        raise AutopipeError("--dtype fp16 on --engine deepspeed: use bf16 (autocast, fp32 weights), or fp16 on --engine torch.")
    cfg.pop("bf16", None)
    cfg.pop("fp16", None)
    if getattr(args, "zero", None) is not None:  # --zero given: it wins over the file's stage
        from .zero import check_zero

        cfg["zero_optimization"] = {**(cfg.get("zero_optimization") or {}), "stage": check_zero(args.zero)}
    stage = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    if stage >= 1:
        cfg["zero_allow_untested_optimizer"] = True  # autopipe's AdamW (see _ClippingAdamW) is a client optimizer
    if stage > 1:
        raise AutopipeError(f"ZeRO stage {stage} in the ds_config: DeepSpeed's pipeline engine allows stage 0 or 1.")
    cfg["gradient_clipping"] = config.grad_clip if stage >= 1 else 0.0  # stage 0: _ClippingAdamW clips
    cfg.pop("optimizer", None)  # built here (see ds_config)
    cfg.pop("scheduler", None)
    return cfg, config


def _refuse(args: Any) -> None:
    """Flags the DeepSpeed engine does not run: one line each, before anything starts."""
    from .layout import schedule_name

    if getattr(args, "verify", False):
        raise AutopipeError("--verify runs on the torch engine (--engine torch); DeepSpeed's engine has no unpipelined twin to compare with.")
    if getattr(args, "recompute", "plan") not in ("plan", "none"):
        raise AutopipeError("--recompute selective|full runs on the torch engine; with DeepSpeed set activation checkpointing in ds_config.json.")
    zero = getattr(args, "zero", None)
    if zero is not None and str(zero).strip() in ("2", "3"):
        raise AutopipeError(f"--zero {zero} on --engine deepspeed: DeepSpeed's pipeline engine runs ZeRO 0 or 1 only; "
                            "use --engine torch (FSDP2) for ZeRO 2 or 3.")
    if schedule_name(getattr(args, "schedule", "1f1b")) not in ("1F1B", "GPipe"):
        raise AutopipeError(f"--schedule {args.schedule}: DeepSpeed runs its own 1F1B schedule; use --engine torch for {args.schedule}.")


def _refuse_plan(plan: Any, plan_path: str, args: Any) -> None:
    """A plan whose chunks recompute (its memory counted on it) does not run as planned on DeepSpeed."""
    modes = tuple(getattr(plan, "stage_recompute", ()) or ())
    if getattr(args, "recompute", "plan") == "plan" and any(m != "none" for m in modes):
        raise AutopipeError(
            f"{plan_path} recomputes activations ({' '.join(modes)}), which --engine deepspeed does not do: "
            "re-plan with --recompute none, pass --recompute none to run it without, or use --engine torch."
        )


def train_deepspeed(source: Any, plan_path: str, config: TrainConfig, args: Any, *, seq_len: int) -> list[float]:
    """Train with DeepSpeed's PipelineEngine (what train.py runs for ``--engine deepspeed``).

    Launch with torchrun or the deepspeed launcher; on a CPU the gloo backend is used. Checkpoints
    are DeepSpeed's own (``engine.save_checkpoint``, one tag per step), so ``--resume``,
    ``--ckpt-every`` and ``--export`` work as on the torch engine. Returns the per-step losses.
    """
    _refuse(args)
    plan = None if plan_path == "even" else load_plan(plan_path)
    _refuse_plan(plan, plan_path, args)
    os.environ.setdefault("LOCAL_RANK", "0")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise AutopipeError("--engine deepspeed needs DeepSpeed: pip install deepspeed (or --engine torch).") from None
    import torch.distributed as dist

    from .build import MicrobatchSeeds
    from .comm import Comm, checking_requested
    from .distenv import rank_device
    from .logs import StepLogger
    from .main import check_launch
    from .tasks import JobData, make_loss
    from .trainer import StepStats

    device = rank_device()
    if "WORLD_SIZE" not in os.environ:  # plain `python train.py`: a one-rank world
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    world = dist.get_world_size()
    dp = args.dp
    if dp < 1 or world % dp:
        raise AutopipeError(f"world size {world} is not a multiple of --dp {dp}; launch dp x stages processes.")
    pp = world // dp
    rank = dist.get_rank()
    if plan is not None:
        check_launch(plan, pp, dp, plan_path=plan_path)
    ctx = _Context(source.factory, source.args, source.kwargs, seed=config.seed,
                   weights=args.weights or source.weights, device=device)
    num_layers = len(ctx.seq.layers)
    boundaries = even_boundaries(num_layers, pp) if plan is None else list(plan.boundaries)
    if len(boundaries) - 1 != pp:
        raise AutopipeError(
            f"DeepSpeed runs one chunk per stage but the plan has {len(boundaries) - 1} chunks for {pp} stages; "
            "make a plan without virtual stages for --engine deepspeed."
        )
    seq = ctx.seq
    data = JobData(source, args.data, seq_len=seq_len, seed=config.seed, seq=seq)
    user_loss = make_loss(source.loss)

    def loss_fn(outputs: Any, target: Any) -> torch.Tensor:
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        unpacked = seq.unpack_outputs(tuple(t.bool() if t.dtype == torch.uint8 else t for t in outs))
        return model_loss(unpacked) if user_loss is None else user_loss(unpacked, target)

    job_config = Path(sys.argv[0]).resolve().with_name("ds_config.json")
    cfg, config = _load_ds_config(args.deepspeed_config or (str(job_config) if job_config.is_file() else None), config, args, dp)
    zero = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    module = build_pipeline_module(ctx, boundaries, pp, loss_fn)
    for layer in ctx.built:
        layer.autocast_dtype = config.autocast_dtype
    params = {n: p for n, p in module.named_parameters()}
    optimizer = make_optimizer(params, config, cls=_ClippingAdamW)
    scheduler = make_lr_scheduler(optimizer, config)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
    comm = Comm(device, checking=bool(getattr(args, "check", False)) or checking_requested())
    if zero == 0:  # the norm is taken (and logged) always; a clip of 0 only skips the scaling
        optimizer.clip = _make_clip(module, engine.grid.get_pipe_parallel_group(), config.grad_clip, comm)
    log = StepLogger(rank, json_path=args.log_json, unit=data.unit)
    dp_rank = engine.grid.get_data_parallel_rank()
    stage = engine.grid.get_stage_id()
    log.info(f"{source.name}: {num_layers} layers, stages {boundaries} on DeepSpeed x {dp} replica(s), "
             f"{config.microbatches} micro-batches, ZeRO {zero}, loss {source.loss if isinstance(source.loss, str) else 'factory'}, "
             f"data {data.state()['source']}")
    start = _ds_resume(engine, args, config, log)
    rows = args.batch_size * config.microbatches * dp
    losses = []
    for step in range(start, config.steps):
        batch_args, batch_kwargs, target = data.batch(step, rows, replica=dp_rank, replicas=dp,
                                                      inputs=engine.is_first_stage(), target=engine.is_last_stage())
        targets = list(target.chunk(config.microbatches)) if target is not None else [torch.zeros(1)] * config.microbatches
        micro = [
            # host tensors: DeepSpeed's engine copies each micro-batch to its device when it loads it
            (seq.pack_inputs(a, k), t) for (a, k), t in zip(split_batch(batch_args, batch_kwargs, config.microbatches), targets)
        ]
        seeds = MicrobatchSeeds(config.seed, step, dp_rank * config.microbatches)
        for layer in ctx.built:
            layer.seeds, layer.microbatch = seeds, 0
        lr = optimizer.param_groups[0]["lr"]
        t0 = time.perf_counter()
        loss = float(engine.train_batch(data_iter=iter(micro)))
        dt = time.perf_counter() - t0
        losses.append(loss)
        norm = _norm_value(optimizer.last_norm) if zero == 0 else float(engine.get_global_grad_norm() or float("nan"))
        count = rows * seq_len if data.unit == "tok" else rows
        log.step(StepStats(step=step + 1, loss=loss, lr=lr, grad_norm=norm, step_time=dt,
                           tokens_per_s=count / dt if dt > 0 else 0.0, stage_times=[dt]))
        if (args.ckpt_every and (step + 1) % args.ckpt_every == 0) or step + 1 == config.steps:
            _ds_save(engine, args.ckpt_dir, step + 1, keep=args.ckpt_keep, data=data.state(), rank=rank, steps=config.steps)
    final = Path(args.ckpt_dir) / "deepspeed_final"
    meta = {"step": config.steps, "pp": pp, "dp": dp, "tied": {g.canonical: list(g.names) for g in seq.tied}}
    _save_final(module, final, stage, write=dp_rank == 0, meta=meta if rank == 0 else None)
    dist.barrier()
    if rank == 0 and args.export:
        from .checkpoint import export

        log.info(f"exported {export(final, args.export, model_fn=source.factory)}")
    # leave together: a rank exiting while DeepSpeed's comm threads still run aborts the process
    dist.barrier()
    dist.destroy_process_group()
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


def _ds_resume(engine: Any, args: Any, config: TrainConfig, log: Any) -> int:
    """``--resume`` through DeepSpeed's ``load_checkpoint``: the step to continue from."""
    from .main import ResumeError

    if not args.resume:
        return 0
    root = Path(args.ckpt_dir)
    tags = _ds_tags(root)
    if not tags:
        if args.resume == "auto":
            log.info(f"no checkpoint in {root}: starting at step 0 (--resume auto)")
            return 0
        raise ResumeError(f"--resume: no DeepSpeed checkpoint in {root}; check --ckpt-dir, or use --resume auto to start afresh.")
    path, client = engine.load_checkpoint(str(root), tag=tags[-1].name)
    if path is None:
        raise ResumeError(f"{tags[-1]} could not be loaded by DeepSpeed; it was saved with another layout (stages, --dp).")
    step = int(client["step"])
    log.info(f"resumed from {tags[-1]} at step {step}")
    if client.get("steps") and int(client["steps"]) != config.steps:
        log.info(f"note: the checkpoint was trained for --steps {client['steps']}; the learning rate now decays over "
                 f"{config.steps} steps from step {step}")
    if step >= config.steps:
        raise ResumeError(f"{tags[-1]} is at step {step}, already at --steps {config.steps}: pass a larger --steps to train on.")
    return step
