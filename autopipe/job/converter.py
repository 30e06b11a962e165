"""convert: every pass in a row, from a model name to a job folder (what `autopipe convert` runs).

    check -> load -> flatten (+ checks) -> profile -> partition or search (+ baselines) -> emit

The options arrive as one record (``ConvertSettings``), checked when it is made; the job folder and
the data file are checked next, so a typo fails in milliseconds, not after a minute of profiling.
Each pass is one short step below; ``ConvertResult.seconds`` says how long each took.

Example:
    >>> import tempfile
    >>> out = tempfile.mkdtemp() + "/gpt2"
    >>> result = convert("gpt2", stages=4, out=out, seq_len=64, estimate=True, device="h100", progress=False)
    >>> result.plan.stages, result.job.launch == f"torchrun --nproc-per-node 4 {out}/train.py"
    (4, True)
    >>> convert("gpt2", ConvertSettings(stages=4, engine="deepspeed", schedule="zbv"))
    Traceback (most recent call last):
    ...
    autopipe.errors.AutopipeError: --schedule zbv does not run on --engine deepspeed (its own 1F1B schedule; bf16 or fp32): drop it or use --engine torch (or auto).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..choices import PRECISIONS, ZERO_STAGES
from ..costs.layer_costs import Profile
from ..errors import AutopipeError, PartitionError
from ..planner.plan import Plan
from .folder import JobFiles, check_job_dir, emit
from .settings import ConvertSettings, JobSettings, refuse_unknown

__all__ = ["ConvertResult", "ConvertSettings", "convert", "default_job_dir"]


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
    options: ConvertSettings | None = None  # what convert was asked for
    engine_choice: Any = None  # with --engine auto: each engine's plan and why the job's won (planner.engine_choice)
    schedule_choice: Any = None  # with --schedule auto: each schedule's plan and why the job's won (planner.schedule_choice)


def default_job_dir(model: str) -> Path:
    """jobs/<name>: the built-in name, the folder's name, or for a factory its file stem or module
    name and its function's name (``skip.py:branchy`` and ``skip.py:straight`` are two jobs).

    Example:
        >>> default_job_dir("models/Llama-3.2-1B"), default_job_dir("pkg.nets:build"), default_job_dir("tiny.py:build")
        (PosixPath('jobs/Llama-3.2-1B'), PosixPath('jobs/nets-build'), PosixPath('jobs/tiny-build'))
    """
    base = model.rstrip("/\\")
    target, colon, function = base.rpartition(":")
    if Path(base).is_dir():
        stem = Path(os.path.abspath(base)).name  # dots are part of a folder's name (Llama-3.2-1B); "." too
    elif not colon:
        stem = Path(base).name  # a built-in name
    elif target.endswith(".py"):
        stem = f"{Path(target).stem}-{function}"  # file.py:function
    else:
        stem = f"{target.rsplit('.', 1)[-1]}-{function}"  # package.module:function -> module-function
    return Path("jobs") / (re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-.") or "model")


def convert(model: str, settings: ConvertSettings | None = None, /, *,
            on_pass: Callable[[str], None] | None = None, **options: Any) -> ConvertResult:
    """Trace, flatten, profile and partition ``model``, then write its job folder.

    Args:
        model: a built-in name (``gpt2``), a local HuggingFace folder, or ``module:function`` /
            ``file.py:function`` returning a model (and example inputs).
        settings: the options as one record (``ConvertSettings``: stages or gpus, schedule,
            precision, memory limit, engine, the job folder ...; each field says what it does).
        on_pass: called with each pass's name as it starts (the CLI prints it).
        **options: the same options as keywords (``stages=4``): they build the record, or with
            ``settings`` replace its fields.

    Raises:
        AutopipeError: with what was wrong and how to fix it (a misspelled option names the one
            meant); nothing is written then.
    """
    s = _settings(settings, options)
    if s.ds_config is not None:  # the user's DeepSpeed settings are what the plan is made for
        from .ds_config import apply_ds_config, read_ds_config

        s = apply_ds_config(s, read_ds_config(s.ds_config), str(s.ds_config))
    job_dir = _check_destination(s, model)
    passes = _Passes(on_pass)
    with passes("load"):
        loaded = _load(model, s)
        s = _traced_width(s, loaded.spec)
    with passes("flatten"):
        seq = _flatten(model, loaded, s)
    with passes("profile"):
        prof = _profile(model, loaded, seq, s)
    with passes("partition"):
        prof, plan, found, choice, schedule_choice = _partition(prof, s)
        plan = replace(plan, trace_device=seq.trace_device)
        from ..planner.partitioner import compare_baselines

        baselines = compare_baselines(prof, plan)
    with passes("emit"):
        batch_size = found.best.microbatch_size if found is not None else loaded.spec.batch_size
        job_settings = JobSettings(
            model=_absolute_spec(model), stages=plan.stages, microbatches=plan.microbatches, schedule=plan.schedule,
            batch_size=batch_size, seq_len=s.seq_len, dtype=s.dtype, engine=_job_engine(s, plan), device=s.device, seed=s.seed,
            loss=s.loss, data=os.path.abspath(s.data) if s.data is not None else None,
            eval_data=os.path.abspath(s.eval_data) if s.eval_data is not None else None, **s.optimizer_settings(),
            ds_config=os.path.abspath(s.ds_config) if s.ds_config is not None else None,
        )  # fmt: skip
        job = emit(job_dir, settings=job_settings, profile=prof, plan=plan, baselines=baselines, force=s.force,
                   search=found)
    return ConvertResult(job_settings, prof, plan, baselines, job, passes.seconds, found, s, choice, schedule_choice)


def _settings(settings: ConvertSettings | None, options: dict[str, Any]) -> ConvertSettings:
    """The record: made from the keywords, or the given one with the keywords replacing its fields."""
    if settings is None:
        return ConvertSettings.from_options(**options)
    refuse_unknown("convert option", options, ConvertSettings.names())
    return replace(settings, **options) if options else settings


def _check_destination(s: ConvertSettings, model: str) -> Path:
    """The model can be found (a misspelled name or factory function says what was meant), the job
    folder is free (refused if it holds files, unless forced) and the data files exist: before any work."""
    from ..graph.sources import check_source

    check_source(model)
    job_dir = Path(s.out) if s.out is not None else default_job_dir(model)
    check_job_dir(job_dir, force=s.force)
    from ..runtime.data.files import check_data_path

    for flag, given in (("--data", s.data), ("--eval-data", s.eval_data)):
        if given is not None:
            check_data_path(Path(given), flag=flag)
    return job_dir


class _Passes:
    """Announces each pass as it starts and records how long it took."""

    def __init__(self, say: Callable[[str], None] | None) -> None:
        self.say = say or (lambda _name: None)
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.say(name)
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start


@dataclass(frozen=True)
class _Loaded:
    """The model as the passes see it: on the device it is profiled on, in the precision it trains in."""

    model: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    loss: Any  # what the job trains with (resolve_loss)
    spec: Any  # load_model's ModelSpec: config, task, the factory's data
    reserve: int | None  # measured early on a GPU (runtime.reserve), else at profile time


def _load(model: str, s: ConvertSettings) -> _Loaded:
    import torch

    from ..graph.sources import load_model
    from ..runtime.data.losses import resolve_loss

    spec = load_model(model, device="meta" if s.estimate else "cpu", batch_size=s.batch_size, seq_len=s.seq_len,
                      seed=s.seed)  # fmt: skip
    # a model trained with another loss than its own is traced (and profiled) as it will run: without labels
    job_loss, kwargs = resolve_loss(model, spec.task, spec.loss, s.loss, spec.kwargs)
    m, args = spec.model, spec.args
    if s.dtype != "fp32" and s.estimate:
        # Measured, the fp32 model runs under autocast as train.py trains it. Estimated on meta there
        # is no autocast: the 16-bit model stands in for its activations (see profile(autocast=...)).
        torch_dtype = getattr(torch, PRECISIONS[s.dtype])
        m = m.to(torch_dtype)
        args, kwargs = _cast_floats((args, kwargs), torch_dtype)
    if not s.estimate and s.device == "cuda" and not torch.cuda.is_available():
        raise AutopipeError("--device cuda was asked for but torch sees no CUDA device; use --device cpu or --estimate.")
    reserve = None
    if not s.estimate and s.device == "cuda":
        # the runtime's reserve is measured before this process holds the model on the GPU: else the
        # probe sees a device this process already fills (it then measures, but caches nothing)
        reserve = _reserve(spec, s)
        m = m.to("cuda")
        args, kwargs = _move((args, kwargs), "cuda")
    return _Loaded(m, args, kwargs, job_loss, spec, reserve)


def _traced_width(s: ConvertSettings, spec: Any) -> ConvertSettings:
    """The settings with the sequence length a factory's token inputs really have: a factory that fixes
    its own (ignoring seq_len) is traced at that width, and the job's rows (synthetic or --data windows)
    must be as wide, or its first step fails on the traced shape."""
    if spec.source != "factory" or not spec.seq_len or spec.seq_len == s.seq_len:
        return s
    return replace(s, seq_len=spec.seq_len)


def _trace_autocast(s: ConvertSettings) -> Any:
    """The 16-bit dtype convert traces under: the one the job trains in (an estimate's model is in 16 bits already)."""
    return None if s.dtype == "fp32" or s.estimate else PRECISIONS[s.dtype]


def _flatten(model: str, loaded: _Loaded, s: ConvertSettings) -> Any:
    """The layer sequence, refused before profiling when the job could not train or not be cut."""
    from ..graph.flattener import flatten

    # traced for the device the job will train on (a measured model is traced where it is), under
    # the autocast it trains in, as each rank traces it again (build_stage); an estimate's model is
    # in 16 bits already (_load)
    seq = flatten(loaded.model, loaded.args, loaded.kwargs, device_type="cpu" if s.device == "cpu" else "cuda",
                  autocast=_trace_autocast(s))
    _check_job_inputs(model, seq, loaded.loss, s, factory_data=loaded.spec.data is not None, rows=loaded.spec.batch_size)
    per_stage = s.chunks_per_stage
    if s.gpus is None and s.stages * per_stage > len(seq.layers):  # type: ignore[operator]
        most = len(seq.layers) // per_stage
        per = f" ({per_stage} chunks per stage under {s.schedule})" if per_stage > 1 else ""
        raise PartitionError(
            f"{model} flattens into {len(seq.layers)} layers, too few for {s.stages} stages{per}; "
            f"use --stages {most} or fewer."
        )
    return seq


def _profile(model: str, loaded: _Loaded, seq: Any, s: ConvertSettings) -> Profile:
    from ..costs.profiler import profile

    prof = profile(seq, loaded.args, loaded.kwargs, device=s.device, estimate=s.estimate, repeats=s.repeats,
                   warmup=s.warmup, autocast=PRECISIONS[s.dtype] if s.dtype != "fp32" else None,
                   progress=s.progress, reserve=_reserve(loaded.spec, s) if loaded.reserve is None else loaded.reserve,
                   optimizer=s.optimizer_state, tp_shapes=s.tp > 1 or s.gpus is not None)  # fmt: skip
    prof = _with_expert_loads(model, loaded, seq, s, prof)
    prof = _with_tp_timing(loaded, seq, s, prof)
    return replace(prof, model=model, rank_excess_bytes=_excess(loaded.spec, s), device=with_host_links(prof.device))


# Batches whose routing a MoE profile counts (autopipe.costs.moe_shape): the micro-batch profiled and,
# where the job has data (--data, the factory's), more of it: a forward each, no timing.
MOE_BATCHES = 8


def _with_expert_loads(model: str, loaded: _Loaded, seq: Any, s: ConvertSettings, prof: Profile) -> Profile:
    """``prof`` with each MoE layer's experts and their token loads over the job's own batches."""
    from ..costs.moe_shape import expert_modules, moe_shapes, with_moe_shapes

    if not expert_modules(loaded.model):
        return prof
    batches: list[Any] = [(loaded.args, loaded.kwargs)]
    if s.data is not None or loaded.spec.data is not None:
        from ..runtime.data.factory import model_factory
        from ..runtime.data.tasks import JobData

        rows = loaded.spec.batch_size
        source = model_factory(model, batch_size=rows, seq_len=s.seq_len, seed=s.seed, loss=s.loss)
        data = JobData(source, str(s.data) if s.data is not None else None, seq_len=s.seq_len, seed=s.seed)
        device = "cuda" if not s.estimate and s.device == "cuda" else None
        for step in range(MOE_BATCHES - 1):
            args, kwargs, _ = data.batch(step, rows)
            batches.append(_move((args, kwargs), device) if device else (args, kwargs))
    prof = with_moe_shapes(prof, moe_shapes(loaded.model, seq, batches))
    if s.estimate:
        return prof
    from ..runtime.checks.ep_timing import with_ep_local_timed  # what ep adds of its own ops (costs.ep's ℓ)

    return with_ep_local_timed(prof, device=s.device, warmup=s.warmup, repeats=s.repeats)


def _with_tp_timing(loaded: _Loaded, seq: Any, s: ConvertSettings, prof: Profile) -> Profile:
    """A measured CPU profile with each layer timed at ``--tp`` (with --gpus: at every degree the search
    tries) as the runtime runs it (DTensor, on a fake process group here: autopipe.runtime.checks.tp_timing),
    which the plan then prices a tp rank's compute by (autopipe.costs.tp); an estimate or a GPU's
    profile as it is (priced by shares)."""
    if s.estimate or prof.device.type != "cpu":
        return prof
    from ..costs.tp import with_tp_timed
    from ..graph.expert_calls import experts_as_calls, experts_calls_of
    from ..graph.flattener import flatten
    from ..runtime.checks.tp_timing import time_at_tp

    tps = [t for t in _searched_tps(prof, s) if t > 1]
    if tps and experts_calls_of(loaded.model):  # traced as a tp job traces it: each experts call one op (build_stage)
        with experts_as_calls(loaded.model):
            again = flatten(loaded.model, loaded.args, loaded.kwargs, device_type="cpu", autocast=_trace_autocast(s))
        if [i.name for i in again.infos] == [i.name for i in seq.infos]:
            seq = again
        else:  # timed replicated, the MoE blocks would read slower than the job runs them: say so
            import warnings

            warnings.warn("the MoE model traced with its experts calls as one op flattens into other layers; its "
                          "layers are timed at tp as traced for the profile (MoE blocks replicated)", stacklevel=2)
    for t in tps:
        try:
            ratios = time_at_tp(seq, loaded.model, loaded.args, loaded.kwargs, t, sequence_parallel=s.sequence_parallel,
                                warmup=s.warmup, repeats=s.repeats)  # fmt: skip
        except AutopipeError as e:  # a plan still can: by the shares tp divides
            import warnings

            warnings.warn(f"could not time the layers at tp {t} here ({e}); a tp rank's compute is priced by the "
                          "shares tp divides", stacklevel=2)  # fmt: skip
            continue
        prof = with_tp_timed(prof, t, ratios, sequence_parallel=s.sequence_parallel)
    return prof


def _searched_tps(prof: Profile, s: ConvertSettings) -> list[int]:
    """The tp degrees convert plans at: ``--tp``; with --gpus and no --tp every degree dividing a node's
    devices that the profile's layers can be split at (torch's engine only: DeepSpeed's runs none)."""
    if s.gpus is None or "tp" in (s.fixed or ()):
        return [s.tp]
    if s.engine == "deepspeed":
        return [1]
    from ..costs.tp import tp_degrees_for

    return tp_degrees_for(prof, _cluster(prof, s).gpus_per_node) or [1]


def _cluster(prof: Profile, s: ConvertSettings) -> Any:
    from ..cluster.topology import cluster_for

    device = prof.device.name if prof.device.type == "cuda" else s.device
    return cluster_for(device, s.gpus, s.gpus_per_node, s.bandwidth_intra, s.bandwidth_inter)  # type: ignore[arg-type]


def with_host_links(device: Any) -> Any:
    """A CPU profile's DeviceInfo with its host's gloo collectives (measured once per host and cached:
    autopipe.runtime.checks.links), which tp and ep are priced at; a GPU's as it is."""
    if device.type != "cpu":
        return device
    from ..runtime.checks.links import host_links

    try:
        links = host_links()
    except (AutopipeError, OSError) as e:  # the probe's 2 gloo processes could not run here: a plan still can
        import warnings

        warnings.warn(f"could not measure this host's gloo collectives ({e}); tp and ep on this CPU are "
                      "priced at the stated link figures", stacklevel=2)  # fmt: skip
        return device
    return replace(device, links=links)


def _reserve(spec: Any, s: ConvertSettings) -> int:
    from ..runtime.checks.reserve import reserve_for

    return reserve_for(s.device, estimate=s.estimate, given=s.reserve, dtype=s.dtype,
                       config=getattr(spec.model, "config", None), progress=s.progress)


def _excess(spec: Any, s: ConvertSettings) -> int:
    """What a CPU rank may hold beyond its predicted tensors, from the reserve's probe (measured with
    the reserve: the memory advice sets it beside the tensors); 0 where not measured."""
    from ..runtime.checks.reserve import excess_for

    return excess_for(s.device, estimate=s.estimate, given=s.reserve, dtype=s.dtype,
                      config=getattr(spec.model, "config", None)) or 0


def _partition(prof: Profile, s: ConvertSettings) -> tuple[Profile, Plan, Any, Any, Any]:
    """(the profile the plan is for, the plan, the SearchResult or None, the EngineChoice or None, the
    ScheduleChoice or None): the cut for ``stages`` costed for the job's engine (with ``auto``, each
    engine's best cut and the faster of them) and run by its schedule (with ``auto``, each schedule the
    engine runs planned and the fastest kept), or with ``gpus`` the best layout of the cluster search
    (its profile rescaled to the micro-batch it chose; the search chooses the schedule itself)."""
    if s.gpus is not None:
        return (*_search(prof, s), None, None)
    from ..planner.engine_choice import plan_engines
    from ..planner.partitioner import partition
    from ..planner.schedule_choice import plan_schedules

    # Interleaved schedules need chunks to interleave: two per rank (partition's default), the
    # smallest that helps; auto plans each schedule with its own.
    options = dict(microbatches=s.microbatches, schedule=s.schedule, memory_limit=s.memory_limit, recompute=s.recompute,
                   dp=s.dp, zero=s.zero, target=s.target, optimizer=s.optimizer_state)  # fmt: skip
    # the cut is solved for what one tp (and ep) rank computes and holds
    whole, prof = prof, _ep_rank_view(_tp_rank_view(prof, s), s)
    choice = schedule_choice = None
    if s.engine == "auto":
        choice = plan_engines(prof, s.stages, dtype=s.dtype, **options)  # type: ignore[arg-type]
        plan, schedule_choice = choice.plan, choice.schedule_choice
    elif s.schedule == "auto":
        del options["schedule"]
        schedule_choice = plan_schedules(prof, s.stages, engine=s.engine, **options)  # type: ignore[arg-type]
        plan = schedule_choice.plan
    else:
        plan = partition(prof, s.stages, engine=s.engine, **options)  # type: ignore[arg-type]
    if s.gpus_per_node is not None:  # the job's launch lines (and train.sbatch) span the nodes it needs
        plan = replace(plan, gpus_per_node=s.gpus_per_node)
    if s.tp > 1:
        plan = replace(plan, tp=s.tp, sequence_parallel=s.sequence_parallel)
    if s.ep > 1:
        plan = replace(plan, ep=s.ep)
    return whole, plan, None, choice, schedule_choice


def _tp_rank_view(prof: Profile, s: ConvertSettings) -> Profile:
    """The profile one rank of a tp group of ``s.tp`` sees (autopipe.costs.tp.at_tp: its share of each
    layer's compute, the collectives tp adds over the node's link, the memory it holds); ``prof`` at tp 1."""
    if s.tp == 1:
        return prof
    from ..cluster.evaluate import node_tp_view

    world = s.stages * s.dp * s.tp  # type: ignore[operator]
    return node_tp_view(prof, s.tp, gpus=world, gpus_per_node=s.gpus_per_node or world,
                        bandwidth_intra=s.bandwidth_intra, sequence_parallel=s.sequence_parallel, ep=s.ep)


def _ep_rank_view(prof: Profile, s: ConvertSettings) -> Profile:
    """The profile one rank of an ep group of ``s.ep`` sees at the routing skew the profile counted
    (autopipe.costs.ep.at_ep, p95: its busiest rank's experts, the four all-to-alls, experts' memory / ep)."""
    if s.ep == 1:
        return prof
    from ..cluster.evaluate import node_ep_view

    world = s.stages * s.dp * s.tp  # type: ignore[operator]
    return node_ep_view(prof, s.ep, gpus=world, dp=s.dp, tp=s.tp, gpus_per_node=s.gpus_per_node or world,  # type: ignore[arg-type]
                        bandwidth_intra=s.bandwidth_intra)


def _job_engine(s: ConvertSettings, plan: Plan) -> str:
    """The engine the job trains on: the one asked for, auto's pick, or torch (auto over a cluster
    search, which costs the layers alone)."""
    return plan.engine or (s.engine if s.engine != "auto" else "torch")


def _search(prof: Profile, s: ConvertSettings) -> tuple[Profile, Plan, Any]:
    """The cluster search for convert: stages x replicas x micro-batches x schedule x ZeRO, with tp and
    ep (each searched, or fixed by --tp/--ep): torch's runtime runs every layout it makes.
    DeepSpeed's pipeline engine runs its own 1F1B (or GPipe-like) order, ZeRO 0/1, no tp or ep."""
    from ..cluster.layout_search import search
    from ..cluster.layouts import SEARCH_SCHEDULES
    from ..costs.ep import ep_degrees_for
    from ..costs.rescale import scale_microbatch

    zeros = ZERO_STAGES if s.zero == "auto" else (int(s.zero),)
    schedules = SEARCH_SCHEDULES
    eps = [s.ep] if "ep" in (s.fixed or ()) else ep_degrees_for(prof, s.gpus)  # type: ignore[arg-type]
    if s.engine == "deepspeed":
        zeros, schedules, eps = tuple(z for z in zeros if z <= 1), (("1f1b", 1),), [1]
    tps = _searched_tps(prof, s)
    if s.sequence_parallel and max(tps) == 1:
        raise PartitionError("--sequence-parallel needs a tp of 2 or more, and no tp degree above 1 is searched here "
                             "(the profile's layers do not split, or DeepSpeed's engine); drop --sequence-parallel.")
    # the layout search costs the layers alone (no engine terms); auto then trains on torch
    found = search(prof, _cluster(prof, s), global_batch=s.global_batch, memory_limit=s.memory_limit,
                   recompute=s.recompute, zeros=zeros, schedules=schedules, target=s.target,
                   optimizer=s.optimizer_state, progress=s.progress, tps=tps,
                   sequence_parallel=s.sequence_parallel, eps=eps or [1])  # fmt: skip
    return scale_microbatch(prof, found.best.microbatch_size), found.plan, found


def _absolute_spec(model: str) -> str:
    """``dir`` and ``file.py:function`` as absolute paths, so the job's train.py runs from any folder."""
    target, colon, function = model.rpartition(":")
    if colon and target.endswith(".py") and Path(target).is_file():
        return f"{os.path.abspath(target)}:{function}"
    if Path(model).is_dir():
        return os.path.abspath(model)
    return model


def _check_job_inputs(model: str, seq: Any, job_loss: Any, s: ConvertSettings, *, factory_data: bool, rows: int) -> None:
    """Refuse, before profiling, a job that could not train: no scalar loss, or data (--data, or the
    factory's) that does not fit the model."""
    from ..runtime.data.tasks import JobData
    from ..runtime.data.losses import check_loss

    check_loss(seq, job_loss, model)
    if s.data is not None or factory_data or s.eval_data is not None:
        from ..runtime.data.factory import model_factory

        source = model_factory(model, batch_size=rows, seq_len=s.seq_len, seed=s.seed, loss=s.loss)
        JobData(source, str(s.data) if s.data is not None else None, seq_len=s.seq_len, seed=s.seed, seq=seq)
        if s.eval_data is not None:
            JobData(source, str(s.eval_data), seq_len=s.seq_len, seed=s.seed, seq=seq, shuffle=False,
                    flag="--eval-data")


def _cast_floats(tree: Any, dtype: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v, tree)


def _move(tree: Any, device: str) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, tree)
