"""CLI commands inspect, profile and plan. Each one: parse, call the library, render. Keep them thin."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from .app import app, console, err_console, handle_errors, zero_option

# ---- inspect (issue 2) -------------------------------------------------------------------------

ModelArg = Annotated[
    str, typer.Argument(help="A built-in name (gpt2, llama-7b, ...), a HuggingFace folder, module:function / file.py:function, or torchtitan's torchtitan:MODULE:FLAVOR (torchtitan:llama3:8B).")
]


@app.command("inspect")
@handle_errors
def inspect_command(
    model: ModelArg,
    batch_size: Annotated[Optional[int], typer.Option(help="Micro-batch size of the example input (default: the model's own).")] = None,
    seq_len: Annotated[int, typer.Option(help="Sequence length of the example input.")] = 128,
    device: Annotated[str, typer.Option(help="meta (no weights, any size) or cpu (real weights; the trace is checked numerically).")] = "meta",
    granularity: Annotated[str, typer.Option(help="block: cut at repeated blocks; leaf: at every module with parameters.")] = "block",
    blocks_per_layer: Annotated[int, typer.Option(help="Coarser layers: this many blocks per layer.")] = 1,
    json_output: Annotated[bool, typer.Option("--json", help="Print the layers as JSON.")] = False,
) -> None:
    """Trace and flatten MODEL; print its layer sequence: what each layer holds and passes on."""
    import dataclasses
    import json

    from ..graph.flattener import flatten
    from ..graph.sources import load_model
    from ..report.layer_tables import layer_table, made_on_stage

    spec = load_model(model, device=device, batch_size=batch_size, seq_len=seq_len)
    seq = flatten(spec.model, spec.args, spec.kwargs, granularity=granularity,  # type: ignore[arg-type]
                  blocks_per_layer=blocks_per_layer, name=model)
    if json_output:
        data = {
            "model": model,
            "signature": seq.signature,
            "layers": [dataclasses.asdict(info) for info in seq.infos],
            "tied": [dataclasses.asdict(group) for group in seq.tied],
            "notes": seq.notes,
            "attention": dataclasses.asdict(seq.attention) if seq.attention is not None else None,
        }
        typer.echo(json.dumps(data, indent=1))
        return
    console.print(layer_table(seq, title=f"{model}: {len(seq)} layers"))
    if made := made_on_stage(seq):
        console.print(made, highlight=False)
    if seq.attention is not None and (line := seq.attention.summary()):
        console.print(line, highlight=False)
    for group in seq.tied:
        console.print(f"tied: {' = '.join(group.names)}  (layers {', '.join(map(str, group.layers))})", highlight=False)
    for note in seq.notes:
        console.print(f"[yellow]note:[/] {note}", highlight=False)


# ---- profile (issue 3) -------------------------------------------------------------------------

@app.command("profile")
@handle_errors
def profile_command(
    model: Annotated[str, typer.Argument(help="A built-in name (gpt2), a HuggingFace folder, module:function, or torchtitan:MODULE:FLAVOR (torchtitan:llama3:8B).")],
    device: Annotated[str, typer.Option(help="Measure on cpu or cuda; with --estimate: cpu, cuda, a100, h100, h200.")] = "cpu",
    estimate: Annotated[bool, typer.Option("--estimate", help="Run nothing: FLOPs and bytes on meta tensors, priced by a roofline.")] = False,
    batch_size: Annotated[Optional[int], typer.Option(help="Micro-batch size (default: the model's own).")] = None,
    seq_len: Annotated[int, typer.Option(help="Sequence length of the example input.")] = 128,
    dtype: Annotated[Optional[str], typer.Option(help="Profile in this dtype (default: the model's).")] = None,
    mixed_precision: Annotated[bool, typer.Option("--mixed-precision", help="16-bit params/grads, fp32 master weights and optimizer state.")] = False,
    autocast: Annotated[Optional[str], typer.Option(help="bfloat16 or float16: profile as train.py --dtype bf16|fp16 trains (fp32 weights under autocast).")] = None,
    optimizer: Annotated[str, typer.Option(help="adamw, adam, sgd-momentum, sgd or none: sizes optimizer state.")] = "adamw",
    repeats: Annotated[int, typer.Option(help="Timed runs per measured layer.")] = 10,
    warmup: Annotated[int, typer.Option(help="Untimed runs before timing.")] = 3,
    reserve: Annotated[Optional[str], typer.Option(help="Memory the runtime holds per rank beyond the tensors, like 80MiB (default: measured once per device).")] = None,
    out: Annotated[Path, typer.Option(help="Where to save the profile JSON.")] = Path("profile.json"),
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the profile as JSON instead of a table.")] = False,
) -> None:
    """Measure (or estimate) what each layer costs; print a table and save the profile JSON."""
    import dataclasses
    import json

    import torch
    from torch.utils._pytree import tree_map

    from ..choices import PRECISIONS, precision
    from ..costs.profiler import profile
    from ..errors import AutopipeError
    from ..graph.flattener import flatten
    from ..graph.sources import load_model
    from ..report.tables import profile_table

    if out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to overwrite it, or choose another --out.")
    m, args, kwargs = load_model(model, device="meta" if estimate else "cpu", batch_size=batch_size, seq_len=seq_len)
    autocast = PRECISIONS.get(autocast or "", autocast)
    if dtype is not None or mixed_precision or (autocast is not None and estimate):
        # Convert before flatten: a traced graph keeps the dtypes it was traced in. Estimating with
        # autocast (none on meta), the 16-bit model stands in for autocast's activations.
        target = getattr(torch, dtype or autocast or "bfloat16", None)
        if not isinstance(target, torch.dtype):
            raise AutopipeError(f"unknown --dtype {dtype!r}; use float32, bfloat16 or float16.")
        m = m.to(target)
        args, kwargs = tree_map(lambda v: v.to(target) if isinstance(v, torch.Tensor) and v.is_floating_point() else v,
                                (args, kwargs))
    from ..costs.devices import slow_16bit_cpu_note
    from ..runtime.checks.reserve import excess_for, reserve_for

    emulated = slow_16bit_cpu_note(autocast or dtype or "fp32") if device == "cpu" and not estimate else None
    if emulated and not json_output:  # before the profile it warns of, which may take many minutes
        err_console.print(f"[yellow]warning:[/] {emulated}", highlight=False, soft_wrap=True)
    # measured before the model is on the GPU: a probe beside it would compete with it for memory
    reserve_bytes = reserve_for(device, estimate=estimate, given=reserve, dtype=precision(autocast) if autocast else "fp32",
                                config=getattr(m, "config", None), progress=not json_output)  # fmt: skip
    if not estimate and device != "cpu":
        # Trace where it will be measured: traced graphs keep their device.
        m = m.to(device)
        args, kwargs = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, (args, kwargs))
    # traced under the autocast it is timed in (and a job trains in): the model's fp32 regions stay
    seq = flatten(m, args, kwargs, autocast=None if estimate else autocast)
    prof = profile(seq, args, kwargs, device=device, estimate=estimate, dtype=dtype,
                   mixed_precision=mixed_precision, autocast=autocast, optimizer=optimizer, repeats=repeats, warmup=warmup,
                   progress=not json_output, reserve=reserve_bytes)
    from ..costs.moe_shape import moe_shapes, with_moe_shapes

    prof = with_moe_shapes(prof, moe_shapes(m, seq, [(args, kwargs)]))  # MoE layers: their routing, counted
    if not estimate:
        from ..runtime.checks.ep_timing import with_ep_local_timed  # what ep adds of its own ops (costs.ep's ℓ)

        prof = with_ep_local_timed(prof, device=device, warmup=warmup, repeats=repeats)
    # a CPU rank's most beyond its predicted tensors, from the reserve's probe: the memory advice's figure
    excess = excess_for(device, estimate=estimate, given=reserve, dtype=precision(autocast) if autocast else "fp32",
                        config=getattr(m, "config", None)) or 0  # fmt: skip
    from ..job.converter import with_host_links

    prof = dataclasses.replace(prof, model=model, rank_excess_bytes=excess, device=with_host_links(prof.device))
    prof.save(out)
    if json_output:
        typer.echo(json.dumps(prof.to_dict(), indent=1))
    else:
        console.print(profile_table(prof))
        for warning in prof.warnings:
            if warning != emulated:
                err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
        console.print(f"saved {out}")


# ---- plan (issue 4) ----------------------------------------------------------------------------

@app.command("plan")
@handle_errors
def plan_command(
    profile: Annotated[Path, typer.Argument(help="A profile JSON from `autopipe profile` (or Profile.save).")],
    stages: Annotated[Optional[int], typer.Option("--stages", "-s", help="Pipeline stages (ranks); or --gpus to search the layout.")] = None,
    microbatches: Annotated[Optional[int], typer.Option("--microbatches", "-m", help="Micro-batches per step (default 2 x stages).")] = None,
    schedule: Annotated[str, typer.Option(help="auto (plan every schedule the engine runs, keep the fastest predicted step), gpipe, 1f1b, interleaved1f1b or zbv.")] = "auto",
    memory_limit: Annotated[str, typer.Option("--memory-limit", help="Memory per device, like 80GiB or 512MB; 'device': the profile's GPU memory (no limit for a CPU profile); 'none': no limit.")] = "device",
    virtual_stages: Annotated[Optional[int], typer.Option("--virtual-stages", help="Chunks per rank for interleaved schedules (with --schedule auto: only the schedules that run that many remain).")] = None,
    optimizer: Annotated[Optional[str], typer.Option(help="Recount optimizer state for adamw, adam, sgd-momentum, sgd or none.")] = None,
    bandwidth: Annotated[Optional[str], typer.Option(help="Link bytes per second between ranks, like 25GB; 'none' ignores communication.")] = None,
    method: Annotated[str, typer.Option(help="autopipe, uniform, parameters, type:REGEX, torchtitan or greedy.")] = "autopipe",
    recompute: Annotated[str, typer.Option(help="Activation recompute per chunk: auto (the fastest that fits the limit), none, selective or full.")] = "auto",
    dp: Annotated[int, typer.Option("--dp", help="Data-parallel replicas of each stage (world = stages x dp); memory is per rank.")] = 1,
    zero: Annotated[Optional[str], typer.Option("--zero", help="ZeRO stage over the replicas: 0 (replicate), 1 (+ shard optimizer state), 2 (+ gradients), 3 (+ parameters), or auto (the fastest that fits; the default with --gpus).")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="Search the whole layout (stages x replicas, micro-batches, schedule, recompute, ZeRO) for this many devices.")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option("--gpus-per-node", help="Devices per node (default: 8 for known GPUs; CPU: all on one host).")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Samples per step, all replicas together (with --gpus).")] = None,
    bandwidth_intra: Annotated[Optional[str], typer.Option("--bandwidth-intra", help="Bytes/s per device inside a node, like 450GB (default per known GPU).")] = None,
    bandwidth_inter: Annotated[Optional[str], typer.Option("--bandwidth-inter", help="Bytes/s per device between nodes, like 50GB (default per known GPU).")] = None,
    top: Annotated[int, typer.Option("--top", help="Layouts shown (and kept exact) by the search.")] = 3,
    boundaries: Annotated[Optional[str], typer.Option(help="Your own cut as layer indices, like 0,7,14,21,26.")] = None,
    stage_names: Annotated[Optional[str], typer.Option("--stage-names", help="Your own cut as module names per stage: stages split by ';', names by ',', like 'wte,h.0,h.1;h.2,h.3,ln_f'. A name covers the layers it prefixes.")] = None,
    compare: Annotated[bool, typer.Option("--compare", help="Show the baseline partitioners beside autopipe, and each engine's best plan (torch, deepspeed).")] = False,
    engine: Annotated[Optional[str], typer.Option("--engine", help="Cost the cut for the engine the job trains on, by its measured overheads: torch, deepspeed, or auto (the faster that can run the options). Default: the layers alone.")] = None,
    for_target: Annotated[Optional[str], typer.Option("--for", help="Plan for the engine you run: torchtitan, megatron, deepspeed or fqns (cut only between whole modules, only what it runs); then `autopipe export`.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Save the plan JSON here.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help="Print the plan (and comparison) as JSON.")] = False,
    tp: Annotated[Optional[str], typer.Option("--tp", help="Tensor-parallel degree inside each stage (world = stages x dp x tp; dividing a node's devices): a number; with --gpus also auto (1, 2, 4, 8: the default there) or a list like 1,8.")] = None,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help="With tp > 1: norms, dropouts and the activations between the tp regions sharded on the sequence (Megatron's sequence parallelism).")] = False,
    ep: Annotated[int, typer.Option("--ep", help="Expert-parallel degree (MoE profiles): each MoE layer's experts sharded over ep of the --dp replicas (ep divides dp), tokens sent to them by all-to-all.")] = 1,
    skew: Annotated[str, typer.Option("--skew", help="With --ep > 1, the router's load the plan prices: p95 (the busiest expert rank at the 95th percentile of the batches profiled), p50, or balanced.")] = "p95",
) -> None:
    """Cut a profiled model into pipeline stages for the shortest simulated step under the memory limit."""
    import dataclasses
    import json

    from ..choices import precision
    from ..costs.engines import check_engine
    from ..costs.layer_costs import Profile
    from ..errors import PartitionError
    from ..planner.baselines import BASELINES
    from ..planner.engine_choice import plan_engines
    from ..planner.partitioner import DEFAULT_BANDWIDTH, partition
    from ..planner.schedule_choice import is_auto, plan_schedules
    from ..report.engine_tables import engine_table
    from ..report.tables import compare_table, plan_summary, plan_table
    from ..units import parse_bandwidth

    if out is not None and out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force to overwrite it.")
    if gpus is not None:
        fixed = [name for name, value in (("--stages", stages), ("--microbatches", microbatches), ("--boundaries", boundaries),
                                          ("--stage-names", stage_names), ("--virtual-stages", virtual_stages),
                                          ("--bandwidth", bandwidth)) if value is not None] + (["--dp"] if dp != 1 else [])
        if ep != 1:  # fixed-layout only for now: the search's ep is autopipe.cluster's to add
            fixed.append("--ep")
        if fixed:
            raise PartitionError(f"{fixed[0]} fixes what --gpus searches; give one or the other.")
        return _plan_search(profile, gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
                            bandwidth_intra=bandwidth_intra, bandwidth_inter=bandwidth_inter, memory_limit=memory_limit,
                            optimizer=optimizer, recompute=recompute, zero=zero, top=top, out=out, force=force,
                            json_output=json_output, target=for_target, tp=tp or "auto",
                            sequence_parallel=sequence_parallel)  # fmt: skip
    if stages is None:
        raise PartitionError("give --stages N (the cut for N stages) or --gpus N (search the whole layout).")
    zero = zero or "0"
    bw = DEFAULT_BANDWIDTH if bandwidth is None else parse_bandwidth(bandwidth)
    cut = None
    if boundaries is not None:
        try:
            cut = [int(x) for x in boundaries.replace(" ", "").split(",") if x]
        except ValueError:
            raise PartitionError(f"--boundaries {boundaries!r}: give layer indices separated by commas, like 0,7,14,26.") from None
    names = None
    if stage_names is not None:  # "a,b;c" -> [["a", "b"], ["c"]]; an empty stage is left for partition to name
        names = [[n.strip() for n in part.split(",") if n.strip()] for part in stage_names.split(";")]
    key = check_engine(engine) if engine is not None else None  # a bad name fails before the profile is read
    prof = Profile.load(profile)
    degree = _tp_fixed(tp)
    if degree > 1 or sequence_parallel:
        prof = _at_tp(prof, degree, sequence_parallel, gpus=stages * dp * degree, gpus_per_node=gpus_per_node,
                      bandwidth_intra=bandwidth_intra, ep=ep)  # fmt: skip
    if ep != 1 or skew != "p95":
        from ..cluster.evaluate import node_ep_view
        from ..costs.ep import check_ep

        check_ep(prof, ep, skew)  # a dense profile, a bad skew: one line before the link is looked up
        prof = node_ep_view(prof, ep, gpus=stages * dp * degree, dp=dp, tp=degree, gpus_per_node=gpus_per_node,
                            bandwidth_intra=parse_bandwidth(bandwidth_intra) if bandwidth_intra else None,
                            bandwidth_inter=parse_bandwidth(bandwidth_inter) if bandwidth_inter else None, skew=skew)  # fmt: skip
    options = dict(microbatches=microbatches, schedule=schedule, memory_limit=memory_limit,
                   optimizer=optimizer, virtual_stages=virtual_stages, bandwidth=bw, recompute=recompute,
                   dp=dp, zero=zero_option(zero))  # fmt: skip
    choice = None
    if key == "auto" or compare:  # every engine's own best plan (method autopipe), the fastest chosen
        dtype = "fp32" if not prof.autocast else precision(prof.autocast)
        choice = plan_engines(prof, stages, dtype=dtype, target=for_target, **options)  # type: ignore[arg-type]
    schedules = None  # with --schedule auto: each schedule's plan and the fastest (planner.schedule_choice)
    if key == "auto" and cut is None and names is None and method == "autopipe":
        assert choice is not None
        plan, schedules = choice.plan, choice.schedule_choice
    else:
        mine = dict(boundaries=cut, stage_names=names, method=method, target=for_target,
                    engine=choice.engine if key == "auto" and choice else key)
        if is_auto(schedule):  # a cut given by hand keeps the schedules with its number of chunks
            schedules = plan_schedules(prof, stages, **mine, **{k: v for k, v in options.items() if k != "schedule"})  # type: ignore[arg-type]
            plan = schedules.plan
        else:
            plan = partition(prof, stages, **mine, **options)  # type: ignore[arg-type]
    others = []
    if compare:  # the baselines under the plan's own schedule
        same = {**options, "schedule": plan.schedule, "virtual_stages": plan.virtual_stages}
        names = ["autopipe"] + [b for b in BASELINES] + ([plan.method] if plan.method not in ("autopipe", *BASELINES) else [])
        others = [plan if m == plan.method else partition(prof, stages, method=m, engine=plan.engine or None, **same)  # type: ignore[arg-type]
                  for m in names]
    if degree > 1:
        plan = dataclasses.replace(plan, tp=degree, sequence_parallel=sequence_parallel)
        others = [dataclasses.replace(p, tp=degree, sequence_parallel=sequence_parallel) for p in others]
    if ep > 1:
        plan = dataclasses.replace(plan, ep=ep)
        others = [dataclasses.replace(p, ep=ep) for p in others]
    if out is not None:
        plan.save(out)
    if json_output:
        data = {"plan": plan.to_dict(), "compare": [p.to_dict() for p in others]}
        if choice is not None:
            data["engines"] = {"chosen": choice.engine, "plans": {e: p.to_dict() for e, p in choice.plans},
                               "skipped": dict(choice.skipped)}
        if schedules is not None:
            data["schedules"] = schedules.to_dict()
        typer.echo(json.dumps(data, indent=1))
        return
    console.print(plan_table(plan))
    console.print(plan_summary(plan), highlight=False)
    if others:
        console.print(compare_table(others))
    if choice is not None:
        console.print(engine_table(choice))
        console.print(choice.why, highlight=False, soft_wrap=True)
    if schedules is not None:
        console.print(schedules.why, highlight=False, soft_wrap=True)
    if out is not None:
        console.print(f"saved {out}", highlight=False)


def _tp_degrees(text: str) -> list[int] | None:
    """--tp: 'auto' -> None (every degree that divides the node), '8' or '1,8' -> the degrees; else one line."""
    from ..errors import PartitionError

    if text.strip().lower() == "auto":
        return None
    try:
        out = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        out = []
    if not out or any(t < 1 for t in out):
        raise PartitionError(f"--tp {text!r}: give a degree like 8, a list like 1,8, or auto.")
    return out


def _tp_fixed(text: Optional[str]) -> int:
    """--tp without --gpus: one degree."""
    from ..errors import PartitionError

    if text is None:
        return 1
    degrees = _tp_degrees(text)
    if degrees is None or len(degrees) != 1:
        raise PartitionError(f"--tp {text}: with --stages give one degree (auto and lists are searched with --gpus).")
    return degrees[0]


def _at_tp(prof: Any, degree: int, sequence_parallel: bool, *, gpus: int, gpus_per_node: Optional[int],
           bandwidth_intra: Optional[str], ep: int = 1) -> Any:  # fmt: skip
    """The profile one rank of a tp group of ``degree`` sees, its collectives over the node's link."""
    from ..cluster.evaluate import node_tp_view
    from ..errors import PartitionError
    from ..units import parse_bandwidth

    if sequence_parallel and degree == 1:
        raise PartitionError("--sequence-parallel needs --tp 2 or more (it shards what tp leaves whole).")
    return node_tp_view(prof, degree, gpus=gpus, gpus_per_node=gpus_per_node, sequence_parallel=sequence_parallel,
                        bandwidth_intra=parse_bandwidth(bandwidth_intra) if bandwidth_intra else None, ep=ep)


def _plan_search(profile: Path, *, gpus: int, gpus_per_node: Optional[int], global_batch: Optional[int],
                 bandwidth_intra: Optional[str], bandwidth_inter: Optional[str], memory_limit: str,
                 optimizer: Optional[str], recompute: str, zero: Optional[str], top: int, out: Optional[Path],
                 force: bool, json_output: bool, target: Optional[str] = None, tp: str = "auto",
                 sequence_parallel: bool = False) -> None:  # fmt: skip
    """`autopipe plan --gpus N`: search the layouts, print the best few, save the best plan (and the layouts)."""
    import json

    from ..choices import ZERO_STAGES
    from ..cluster.layout_search import search
    from ..cluster.layouts import search_path
    from ..cluster.topology import cluster_for
    from ..costs.layer_costs import Profile
    from ..costs.ep import ep_degrees_for
    from ..costs.tp import tp_degrees_for
    from ..errors import PartitionError
    from ..report.search_tables import search_summary, search_table
    from ..report.tables import plan_summary, plan_table
    from ..units import parse_bandwidth

    if global_batch is None or global_batch < 1:
        raise PartitionError("--gpus needs --global-batch N: the samples per step that the layouts divide among replicas.")
    if out is not None and search_path(out).exists() and not force:
        raise FileExistsError(f"{search_path(out)} exists; pass --force to overwrite it.")
    prof = Profile.load(profile)
    z = zero_option(zero or "auto")
    cluster = cluster_for(prof.device.name if prof.device.type != "cpu" else "cpu", gpus, gpus_per_node,
                          parse_bandwidth(bandwidth_intra) if bandwidth_intra else None,
                          parse_bandwidth(bandwidth_inter) if bandwidth_inter else None)  # fmt: skip
    degrees = _tp_degrees(tp)
    if degrees is None:  # auto: every degree dividing a node's devices that the profile can be split at
        degrees = tp_degrees_for(prof, cluster.gpus_per_node) or [1]
    # Said after the search, not before it: a failed search stays one error line.
    tp_note = (tp == "auto" and not json_output and not any(layer.tp is not None for layer in prof.layers))
    if sequence_parallel and degrees == [1]:
        raise PartitionError("--sequence-parallel needs a tp of 2 or more among --tp's degrees.")
    result = search(prof, cluster, global_batch=global_batch, memory_limit=memory_limit, optimizer=optimizer,
                    recompute=recompute, zeros=ZERO_STAGES if z == "auto" else (int(z),), top=max(top, 1),
                    target=target, progress=not json_output, tps=degrees, eps=ep_degrees_for(prof, gpus),
                    sequence_parallel=sequence_parallel)  # fmt: skip
    assert result.plan is not None
    if out is not None:
        result.plan.save(out)
        result.save(str(search_path(out)))
    if json_output:
        typer.echo(json.dumps({"search": result.to_dict(), "plan": result.plan.to_dict()}, indent=1))
        return
    console.print(search_table(result))
    console.print(search_summary(result), highlight=False, soft_wrap=True)
    console.print(plan_table(result.plan, title=f"#1: {result.layouts[0].label}"))
    console.print(plan_summary(result.plan), highlight=False)
    if out is not None:
        console.print(f"saved {out} and {search_path(out)}", highlight=False)
    if tp_note:
        typer.echo("note: tp 1 only: this profile records no tensor-parallel shapes (convert without --tp "
                   "skips them); `autopipe profile` records them.", err=True)
