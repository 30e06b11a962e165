"""convert: every pass in a row, from a model name to a job folder (what `autopipe convert` runs).

    load -> flatten -> profile -> partition (+ baselines) -> emit

Cheap checks come first (options, the job folder, the memory limit), so a typo fails in
milliseconds, not after a minute of profiling.

Example:
    >>> result = convert("gpt2", stages=4, out="jobs/gpt2", seq_len=64)
    >>> result.plan.boundaries, result.job.launch
    ((0, 4, 8, 12, 15), 'torchrun --nproc-per-node 4 jobs/gpt2/train.py')
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..choices import ENGINES, PRECISIONS, precision
from ..costs.layer_costs import Profile
from ..errors import AutopipeError, PartitionError
from ..planner.partitioner import zero_choices
from ..planner.plan import Plan
from ..planner.schedules import normalize_schedule
from ..units import parse_size
from .folder import JobFiles, JobSettings, check_job_dir, emit

__all__ = ["ConvertResult", "convert", "default_job_dir"]



@dataclass(frozen=True)
class ConvertResult:
    """What convert made: the records, the baselines it compared, the job folder, and pass timings."""

    settings: JobSettings
    profile: Profile
    plan: Plan
    baselines: dict[str, Plan]
    job: JobFiles
    seconds: dict[str, float] = field(default_factory=dict)  # per pass, wall clock
    search: Any = None  # the cluster search's SearchResult when convert searched the layout (gpus=)


def default_job_dir(model: str) -> Path:
    """jobs/<name>: the built-in name, the folder's name, or the factory's file stem or module name.

    Example:
        >>> default_job_dir("models/Llama-3.2-1B"), default_job_dir("pkg.nets:build"), default_job_dir("tiny.py:build")
        (PosixPath('jobs/Llama-3.2-1B'), PosixPath('jobs/nets'), PosixPath('jobs/tiny'))
    """
    base = model.rstrip("/\\")
    target, colon, _function = base.rpartition(":")
    if Path(base).is_dir():
        stem = Path(os.path.abspath(base)).name  # dots are part of a folder's name (Llama-3.2-1B); "." too
    elif not colon:
        stem = Path(base).name  # a built-in name
    elif target.endswith(".py"):
        stem = Path(target).stem  # file.py:function
    else:
        stem = target.rsplit(".", 1)[-1]  # package.module:function -> module
    return Path("jobs") / (re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "model")


def convert(
    model: str,
    *,
    stages: int | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    batch_size: int = 1,
    seq_len: int = 128,
    device: str = "cpu",
    dtype: str = "fp32",
    memory_limit: str | int | None = "device",
    recompute: str = "auto",
    dp: int = 1,
    zero: int | str = 0,
    estimate: bool = False,
    engine: str = "torch",
    out: str | os.PathLike[str] | None = None,
    force: bool = False,
    seed: int = 0,
    repeats: int = 5,
    warmup: int = 2,
    reserve: str | int | None = None,
    loss: str = "auto",
    data: str | os.PathLike[str] | None = None,
    progress: bool = True,
    on_pass: Callable[[str], None] | None = None,
    gpus: int | None = None,
    gpus_per_node: int | None = None,
    global_batch: int | None = None,
    bandwidth_intra: float | None = None,
    bandwidth_inter: float | None = None,
) -> ConvertResult:
    """Trace, flatten, profile and partition ``model``, then write its job folder.

    Args:
        model: a built-in name (``gpt2``), a local HuggingFace folder, or ``module:function`` /
            ``file.py:function`` returning a model (and example inputs).
        stages: pipeline stages (one process each).
        microbatches: micro-batches per step (default 2 x stages).
        schedule: gpipe, 1f1b, interleaved1f1b or zbv.
        batch_size, seq_len: the micro-batch the job trains on (and is profiled with).
        device: profile on cpu or cuda; with ``estimate``, the device to estimate for.
        dtype: training precision fp32, bf16 or fp16 (autocast: fp32 weights and optimizer state,
            16-bit matmuls; the profile measures the same).
        memory_limit: per device, e.g. "80GiB"; None or "none": no limit; "device" (the default):
            the GPU's memory when profiling on or estimating for one, no limit on CPU.
        recompute: activation recompute per chunk: auto (the default: the fastest that fits the
            limit, none where nothing binds), none, selective or full.
        dp, zero: data-parallel replicas of each stage and the ZeRO stage (0-3, or "auto") they
            shard with; the plan's memory is per rank under that sharding.
        estimate: run nothing; cost layers from FLOPs and bytes on the meta device (no weights).
        engine: torch (torch.distributed.pipelining) or deepspeed (PipelineModule).
        out: the job folder (default ``jobs/<model name>``); refused if it holds files, unless ``force``.
        repeats, warmup: timed and untimed runs per layer when measuring.
        reserve: memory the training runtime holds per rank beyond the tensors (e.g. "80MiB", 0);
            default: measured once per device (``autopipe.runtime.reserve``), assumed for GPUs estimated.
        loss: what the job trains on: ``auto`` (a factory's loss, else the model's own), ``model``,
            ``cross_entropy`` or ``mse`` (of the model's output against the data's targets); a job
            that cannot produce a scalar loss is refused after flatten, before profiling.
        data: the job's default ``--data`` (checked against the model's inputs before profiling).
        on_pass: called with each pass's name as it starts (the CLI prints it).
        gpus, gpus_per_node, global_batch, bandwidth_intra, bandwidth_inter: instead of ``stages``,
            search the whole layout for this cluster (autopipe.cluster.layout_search): the job gets the best
            layout's stages, replicas (``--dp`` in its launch command), micro-batch size and count,
            schedule, recompute and ZeRO stage; ``batch_size`` is then the size profiled at.

    Raises:
        AutopipeError: with what was wrong and how to fix it; nothing is written then.
    """
    # ---- cheap checks first ----
    if gpus is not None:
        if stages is not None or microbatches is not None or dp != 1:
            what = "--stages" if stages is not None else "--microbatches" if microbatches is not None else "--dp"
            raise PartitionError(f"{what} fixes what --gpus searches; give one or the other.")
        if global_batch is None or global_batch < 1:
            raise PartitionError("--gpus needs --global-batch N: the samples per step that the layouts divide among replicas.")
        stages = 1  # for the checks below; the search chooses
    if stages is None:
        raise PartitionError("give --stages N (the cut for N stages) or --gpus N (search the whole layout).")
    if stages < 1:
        raise PartitionError(f"--stages must be at least 1, got {stages}.")
    if microbatches is not None and microbatches < 1:
        raise PartitionError(f"--microbatches must be at least 1, got {microbatches}.")
    if engine not in ENGINES:
        raise AutopipeError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}.")
    train_dtype = precision(dtype)
    schedule = normalize_schedule(schedule)
    if engine == "deepspeed" and (schedule not in ("1f1b", "gpipe") or train_dtype == "fp16"):
        what = f"--schedule {schedule}" if schedule not in ("1f1b", "gpipe") else "--dtype fp16"
        raise AutopipeError(f"{what} does not run on --engine deepspeed (its own 1F1B schedule; bf16 or fp32): "
                            "drop it or use --engine torch.")
    if memory_limit is not None and str(memory_limit).strip().lower() not in ("device", "none"):
        parse_size(memory_limit)  # a bad size is refused before any work
    from ..choices import RECOMPUTE_POLICIES

    if recompute not in RECOMPUTE_POLICIES:
        raise AutopipeError(f"unknown --recompute {recompute!r}; use one of {', '.join(RECOMPUTE_POLICIES)}.")
    if engine == "deepspeed":  # DeepSpeed's engine recomputes nothing the plan asks for: plan without it
        if recompute in ("selective", "full"):
            raise AutopipeError(f"--recompute {recompute} does not run on --engine deepspeed (set activation "
                                "checkpointing in its ds_config.json): drop it or use --engine torch.")
        recompute = "none"
    zero_choices(zero, dp)  # a bad --dp/--zero is refused before any work
    if engine == "deepspeed" and (zero == "auto" or int(zero) > 1):
        raise AutopipeError(f"--zero {zero} does not run on --engine deepspeed (its pipeline engine has ZeRO 0 and 1 "
                            "only): use --zero 0 or 1, or --engine torch.")
    job_dir = Path(out) if out is not None else default_job_dir(model)
    check_job_dir(job_dir, force=force)
    if data is not None:
        from ..runtime.data import check_data_path

        check_data_path(Path(data))
    # train.py runs from anywhere: a folder or factory file given relative to here is written absolute
    job_model = _absolute_spec(model)
    if estimate and device not in ("cpu", "cuda") and not _is_known_target(device):
        raise AutopipeError(f"unknown --device {device!r}; use cpu or cuda (with --estimate also a100, h100, h200).")
    if not estimate and device not in ("cpu", "cuda"):
        raise AutopipeError(f"--device {device!r} can only be measured as cpu or cuda; add --estimate for {device}.")

    say = on_pass or (lambda _name: None)
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = now - clock
        clock = now

    # ---- load ----
    import torch

    from ..costs.profiler import profile as run_profile
    from ..graph.flattener import flatten
    from ..graph.sources import load_model

    say("load")
    spec = load_model(model, device="meta" if estimate else "cpu", batch_size=batch_size, seq_len=seq_len, seed=seed)
    from ..runtime.tasks import resolve_loss

    # a model trained with another loss than its own is traced (and profiled) as it will run: without labels
    job_loss, spec_kwargs = resolve_loss(model, spec.task, spec.loss, loss, spec.kwargs)
    m, args, kwargs = spec.model, spec.args, spec_kwargs
    torch_dtype = getattr(torch, PRECISIONS[train_dtype])
    if train_dtype != "fp32" and estimate:
        # Measured, the fp32 model runs under autocast as train.py trains it. Estimated on meta there
        # is no autocast: the 16-bit model stands in for its activations (see profile(autocast=...)).
        m = m.to(torch_dtype)
        args, kwargs = _cast_floats((args, kwargs), torch_dtype)
    if not estimate and device == "cuda":
        if not torch.cuda.is_available():
            raise AutopipeError("--device cuda was asked for but torch sees no CUDA device; use --device cpu or --estimate.")
        m = m.to("cuda")
        args, kwargs = _move((args, kwargs), "cuda")
    lap("load")

    # ---- flatten, profile ----
    say("flatten")
    seq = flatten(m, args, kwargs)
    _check_job_inputs(model, seq, job_loss, loss, data, batch_size=batch_size, seq_len=seq_len, seed=seed,
                      factory_data=spec.data is not None)
    lap("flatten")
    chunks_per_rank = 2 if schedule in ("interleaved1f1b", "zbv") else 1
    if gpus is None and stages * chunks_per_rank > len(seq.layers):
        most = len(seq.layers) // chunks_per_rank
        per = f" ({chunks_per_rank} chunks per stage under {schedule})" if chunks_per_rank > 1 else ""
        raise PartitionError(
            f"{model} flattens into {len(seq.layers)} layers, too few for {stages} stages{per}; "
            f"use --stages {most} or fewer."
        )
    say("profile")
    from ..runtime.reserve import reserve_for

    prof = run_profile(seq, args, kwargs, device=device, estimate=estimate, repeats=repeats, warmup=warmup,
                       autocast=PRECISIONS[train_dtype] if train_dtype != "fp32" else None, progress=progress,
                       reserve=reserve_for(device, estimate=estimate, given=reserve, dtype=train_dtype,
                                           config=getattr(spec.model, "config", None)))  # fmt: skip
    prof = _named(prof, model)
    lap("profile")

    # ---- partition ----
    say("partition")
    from ..planner.partitioner import compare_baselines, partition

    # Interleaved schedules need chunks to interleave: two per rank, the smallest that helps.
    virtual = 2 if schedule == "interleaved1f1b" else None
    found = None
    if gpus is not None:
        prof, found = _search(prof, device=device, engine=engine, gpus=gpus, gpus_per_node=gpus_per_node,
                              global_batch=global_batch, intra=bandwidth_intra, inter=bandwidth_inter,
                              memory_limit=memory_limit, recompute=recompute, zero=zero)  # type: ignore[arg-type]
        plan, batch_size = found.plan, found.best.microbatch_size
    else:
        plan = partition(prof, stages, microbatches=microbatches, schedule=schedule, memory_limit=memory_limit,
                         virtual_stages=virtual, recompute=recompute, dp=dp, zero=zero)
    baselines = compare_baselines(prof, plan)
    lap("partition")

    # ---- emit ----
    say("emit")
    settings = JobSettings(
        model=job_model, stages=plan.stages, microbatches=plan.microbatches, schedule=plan.schedule,
        batch_size=batch_size, seq_len=seq_len, dtype=train_dtype, engine=engine, device=device, seed=seed,
        loss=loss, data=os.path.abspath(data) if data is not None else None,
    )  # fmt: skip
    job = emit(job_dir, settings=settings, profile=prof, plan=plan, baselines=baselines, force=force, search=found)
    lap("emit")
    return ConvertResult(settings, prof, plan, baselines, job, seconds, found)


def _search(prof: Profile, *, device: str, engine: str, gpus: int, gpus_per_node: int | None, global_batch: int,
            intra: float | None, inter: float | None, memory_limit: Any, recompute: str, zero: Any) -> tuple[Profile, Any]:  # fmt: skip
    """The cluster search for convert: (the profile at the chosen micro-batch size, the SearchResult).
    DeepSpeed's pipeline engine runs its own 1F1B (or GPipe-like) order and ZeRO 0/1 only."""
    from ..choices import ZERO_STAGES
    from ..cluster.layout_search import search
    from ..cluster.layouts import SEARCH_SCHEDULES
    from ..cluster.topology import cluster_for
    from ..costs.rescale import scale_microbatch

    cluster = cluster_for(prof.device.name if prof.device.type == "cuda" else device, gpus, gpus_per_node, intra, inter)
    zeros = ZERO_STAGES if zero == "auto" else (int(zero),)
    schedules = SEARCH_SCHEDULES
    if engine == "deepspeed":
        zeros, schedules = tuple(z for z in zeros if z <= 1), (("1f1b", 1),)
    found = search(prof, cluster, global_batch=global_batch, memory_limit=memory_limit, recompute=recompute,
                   zeros=zeros, schedules=schedules)  # fmt: skip
    return scale_microbatch(prof, found.best.microbatch_size), found


def _absolute_spec(model: str) -> str:
    """``dir`` and ``file.py:function`` as absolute paths, so the job's train.py runs from any folder."""
    target, colon, function = model.rpartition(":")
    if colon and target.endswith(".py") and Path(target).is_file():
        return f"{os.path.abspath(target)}:{function}"
    if Path(model).is_dir():
        return os.path.abspath(model)
    return model


def _check_job_inputs(model: str, seq: Any, job_loss: Any, loss: str, data: Any, *, factory_data: bool = False,
                      **shape: int) -> None:
    """Refuse, before profiling, a job that could not train: no scalar loss, or data (--data, or the
    factory's) that does not fit the model."""
    from ..runtime.tasks import JobData, check_loss

    check_loss(seq, job_loss, model)
    if data is not None or factory_data:
        from ..runtime.factory import model_factory

        source = model_factory(model, batch_size=shape["batch_size"], seq_len=shape["seq_len"], seed=shape["seed"], loss=loss)
        JobData(source, str(data) if data is not None else None, seq_len=shape["seq_len"], seed=shape["seed"], seq=seq)


def _named(prof: Profile, model: str) -> Profile:
    from dataclasses import replace

    return replace(prof, model=model)


def _is_known_target(name: str) -> bool:
    from ..costs.devices import KNOWN_DEVICES

    return name.lower() in KNOWN_DEVICES


def _cast_floats(tree: Any, dtype: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, tree)


def _move(tree: Any, device: str) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, tree)
