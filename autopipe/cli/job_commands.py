"""`autopipe convert` and `autopipe report`: parse, call autopipe.job.converter / autopipe.report, render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from ..report.predicted import step_text
from ..report.tables import limit_phrase, recompute_phrase, sharding_phrase, stage_table
from .app import app, console, err_console, handle_errors, zero_option

__all__ = ["convert_command", "report_command", "run_command"]


def _is_autopipe_report(path: Path) -> bool:
    """Whether ``path`` is a report autopipe wrote (which `report` may rebuild in place)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "<title>autopipe report" in f.read(4096)
    except OSError:
        return False


@app.command("convert")
@handle_errors
def convert_command(
    model: Annotated[str, typer.Argument(help="A built-in name (gpt2, llama-7b, ...), a HuggingFace folder, module:function / file.py:function, or torchtitan's torchtitan:MODULE:FLAVOR (torchtitan:llama3:8B).")],
    stages: Annotated[Optional[int], typer.Option("--stages", "-s", help="Pipeline stages (one process each); or --gpus to search the layout.")] = None,
    microbatches: Annotated[Optional[int], typer.Option(help="Micro-batches per step (default 2 x stages).")] = None,
    schedule: Annotated[str, typer.Option(help="auto (plan every schedule the engine runs, keep the fastest predicted step), gpipe, 1f1b, interleaved1f1b or zbv.")] = "auto",
    batch_size: Annotated[Optional[int], typer.Option(help="Samples per micro-batch (default: the model's own: a factory's example rows, else 1).")] = None,
    seq_len: Annotated[int, typer.Option(help="Sequence length (language models); small keeps CPU runs quick.")] = 64,
    device: Annotated[str, typer.Option(help="Profile on cpu or cuda; with --estimate also a100, h100, h200.")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Training precision: fp32, bf16 or fp16 (fp32 master weights).")] = "fp32",
    memory_limit: Annotated[str, typer.Option(help="Memory per device, like 80GiB or 512MB; 'device': the GPU's memory (no limit on CPU); 'none': no limit.")] = "device",
    recompute: Annotated[str, typer.Option(help="Activation recompute per chunk: auto (the fastest that fits the limit), none, selective or full.")] = "auto",
    dp: Annotated[int, typer.Option("--dp", help="Data-parallel replicas of each stage (world = stages x dp); memory is per rank.")] = 1,
    tp: Annotated[Optional[int], typer.Option("--tp", help="Tensor-parallel ranks inside each stage (world = stages x dp x tp; torch engine; DTensor, the model's HF tp_plan where it has one); default 1. With --gpus: left out, 1, 2, 4, 8 (dividing a node) are searched; N (1 included) fixes it.")] = None,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help="With --tp: the activations between layers sharded on the sequence over the tp ranks (Megatron's sequence parallelism; planned and run so; with --dp, any ZeRO stage).")] = False,
    ep: Annotated[Optional[int], typer.Option("--ep", help="Expert-parallel degree: each MoE layer's experts shared out over ep of a stage's dp replicas, tokens sent by all-to-all (divides --dp; world unchanged; torch engine, any ZeRO stage). Default 1. With --gpus on a MoE model: left out, 1, 2, 4, 8 are searched; N (1 included) fixes it.")] = None,
    zero: Annotated[Optional[str], typer.Option("--zero", help="ZeRO stage over the replicas: 0, 1 (+ optimizer state sharded), 2 (+ gradients), 3 (+ parameters), or auto (the fastest that fits; the default with --gpus).")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="Search the whole layout (stages x replicas, micro-batches, schedule, recompute, ZeRO, tp, and ep on a MoE model; what the job's runtime runs) for this many devices.")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option("--gpus-per-node", help="Devices per node (default: 8 for known GPUs; CPU: all on one host).")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Samples per step, all replicas together (with --gpus).")] = None,
    bandwidth_intra: Annotated[Optional[str], typer.Option("--bandwidth-intra", help="Bytes/s per device inside a node, like 450GB (default per known GPU).")] = None,
    bandwidth_inter: Annotated[Optional[str], typer.Option("--bandwidth-inter", help="Bytes/s per device between nodes, like 50GB (default per known GPU).")] = None,
    estimate: Annotated[bool, typer.Option("--estimate", help="Run nothing: cost layers from FLOPs and bytes on the meta device.")] = False,
    engine: Annotated[str, typer.Option(help="torch (torch.distributed.pipelining), deepspeed, or auto (the faster of those that can run the options, by each engine's measured overheads).")] = "torch",
    ds_config: Annotated[Optional[Path], typer.Option("--ds-config", help="With --engine deepspeed: your own ds_config.json; its ZeRO stage, bf16, clip and batch keys are planned with, and the job's ds_config.json is it with the plan's pipeline keys.")] = None,
    for_target: Annotated[Optional[str], typer.Option("--for", help="Plan for the trainer you run: torchtitan, megatron, deepspeed or fqns (cut only between whole modules, only what it runs); the job folder then holds its export too.")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Job folder (default jobs/<model name>).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the job files of an existing folder.")] = False,
    repeats: Annotated[int, typer.Option(help="Timed runs per measured layer.")] = 5,
    reserve: Annotated[Optional[str], typer.Option(help="Memory the runtime holds per rank beyond the tensors, like 80MiB (default: measured once per device).")] = None,
    loss: Annotated[str, typer.Option(help="auto (a factory's loss, else the model's own), model, cross_entropy or mse (against the data's targets).")] = "auto",
    data: Annotated[Optional[Path], typer.Option(help="The job's training data: token file, text, .npz/.pt with x and y, or .parquet/.jsonl/.arrow (default: synthetic).")] = None,
    eval_data: Annotated[Optional[Path], typer.Option("--eval-data", help="Held-out data the job evaluates on (as --data): loss, and perplexity or accuracy.")] = None,
    optimizer: Annotated[str, typer.Option(help="adamw, sgd or adafactor (torch's); the plan counts its state.")] = "adamw",
    lr: Annotated[float, typer.Option("--lr", help="Peak learning rate (train.py's default).")] = 3e-4,
    weight_decay: Annotated[float, typer.Option("--weight-decay", help="Weight decay, on matrices only.")] = 0.1,
    betas: Annotated[str, typer.Option("--betas", help="AdamW's betas, like 0.9,0.95.")] = "0.9,0.95",
    momentum: Annotated[float, typer.Option("--momentum", help="SGD's momentum (0: plain SGD, no state).")] = 0.9,
    warmup: Annotated[int, typer.Option("--warmup", help="Steps of linear learning-rate warmup.")] = 0,
    lr_schedule: Annotated[str, typer.Option("--lr-schedule", help="After the warmup: cosine, linear or constant.")] = "cosine",
    grad_clip: Annotated[float, typer.Option("--grad-clip", help="Global gradient-norm clip (0: off).")] = 1.0,
) -> None:
    """Trace, profile and partition MODEL; write a job folder with train.py and report.html."""
    from ..job.converter import convert
    from ..job.settings import ConvertSettings
    from ..units import format_bytes, parse_bandwidth

    if zero is None:  # the search chooses the stage unless told; one fixed cut replicates (ZeRO 0)
        zero = "auto" if gpus is not None and engine == "torch" else "0"
    settings = ConvertSettings(
        stages=stages, microbatches=microbatches, schedule=schedule, dp=dp, tp=tp, sequence_parallel=sequence_parallel, ep=ep, zero=zero_option(zero), gpus=gpus,
        gpus_per_node=gpus_per_node, global_batch=global_batch,
        bandwidth_intra=parse_bandwidth(bandwidth_intra) if bandwidth_intra else None,
        bandwidth_inter=parse_bandwidth(bandwidth_inter) if bandwidth_inter else None,
        batch_size=batch_size, seq_len=seq_len, dtype=dtype, recompute=recompute, engine=engine, loss=loss, data=data,
        target=for_target, device=device, estimate=estimate, memory_limit=memory_limit, reserve=reserve, repeats=repeats,
        out=out, force=force, eval_data=eval_data, optimizer=optimizer, lr=lr, weight_decay=weight_decay,
        betas=_pair("--betas", betas), momentum=momentum, warmup_steps=warmup, lr_schedule=lr_schedule,
        grad_clip=grad_clip, ds_config=ds_config,
    )  # fmt: skip

    def say(name: str) -> None:
        err_console.print(f"[dim]{name}…[/]", highlight=False)

    from ..costs.devices import slow_16bit_cpu_note

    # said before the passes too: the profile it warns of may take many minutes
    emulated = slow_16bit_cpu_note(dtype) if device == "cpu" and not estimate else None
    if emulated:
        err_console.print(f"[yellow]warning:[/] {emulated}", highlight=False, soft_wrap=True)
    result = convert(model, settings, on_pass=say)
    plan, prof = result.plan, result.profile
    if result.search is not None:
        from ..report.search_tables import search_summary, search_table

        console.print(search_table(result.search))
        console.print(search_summary(result.search), highlight=False, soft_wrap=True)
    if result.settings.seq_len != seq_len:  # a factory that fixes its inputs' width, whatever --seq-len says
        err_console.print(f"note: {model}'s example inputs are {result.settings.seq_len} tokens a row, not --seq-len "
                          f"{seq_len}: the job trains rows of {result.settings.seq_len}, the width it was traced at.",
                          highlight=False, soft_wrap=True, markup=False, emoji=False)
    for warning in prof.warnings:
        if warning != emulated:
            err_console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    replicas = f" x {plan.dp} replicas" if plan.dp > 1 else ""
    console.print(stage_table(plan, prof, title=f"{model}: {plan.stages} stages{replicas}, {plan.schedule}, "
                                                f"{plan.microbatches} micro-batches"))
    best = min(result.baselines.items(), key=lambda kv: kv[1].step_time, default=None)
    versus = ""
    if best is not None and plan.step_time > 0:
        gain = best[1].step_time / plan.step_time - 1
        versus = f"; best baseline ({best[0]}) {gain:+.1%}" if abs(gain) >= 0.0005 else f"; best baseline ({best[0]}) equal"
    how = "measured on" if prof.mode == "measured" else "estimated for"
    # the one predicted step (Plan.predicted_step), in the words the README, the report and the step log use
    console.print(f"{how} {prof.device.name}: step {step_text(plan)}, bubble {plan.bubble_fraction:.0%}, "
                  f"balance {plan.balance:.2f}, peak memory {format_bytes(plan.peak_memory)}{limit_phrase(plan)}"
                  f"{sharding_phrase(plan)}{recompute_phrase(plan)}{versus}", highlight=False, soft_wrap=True)
    for choice in (result.engine_choice, result.schedule_choice):
        if choice is not None:
            console.print(choice.why, highlight=False, soft_wrap=True)
    took = sum(result.seconds.values())
    written = ", ".join(p.name for p in result.job.files)  # the job's files, train.sbatch and the like included
    console.print(f"wrote {result.job.job_dir}/ ({written}) in {took:.1f} s", highlight=False, soft_wrap=True)
    console.print("launch:", highlight=False)
    if result.job.first_run:  # one host: a short first run under the launcher that keeps each rank's log
        console.print(f"  {result.job.first_run}", style="bold", highlight=False, soft_wrap=True)
        console.print(f"  or: {result.job.launch}   (torch's launcher itself; train.py's default is 100 steps)",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"  {result.job.launch}", style="bold", highlight=False, soft_wrap=True)


def _pair(flag: str, text: str) -> tuple[float, float]:
    """``"0.9,0.95"`` as two numbers, or a one-line error naming ``flag``."""
    from ..errors import AutopipeError

    parts = text.replace(",", " ").split()
    try:
        a, b = (float(p) for p in parts)
    except ValueError:
        raise AutopipeError(f"{flag} {text!r}: give two numbers, like 0.9,0.95.") from None
    return a, b


@app.command("report")
@handle_errors
def report_command(
    plan_path: Annotated[Path, typer.Argument(metavar="PLAN", help="A plan.json (from convert or plan).")],
    profile_path: Annotated[Optional[Path], typer.Option("--profile", help="Its profile.json (default: beside the plan, if there).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Where to write the HTML (default: report.html beside the plan).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing --out file.")] = False,
    log: Annotated[Optional[Path], typer.Option("--log", help="A train.py --log-json file: show what the run measured beside the predictions.")] = None,
    breakdown: Annotated[Optional[Path], typer.Option("--breakdown", help="A step breakdown (bench/bench_peers.py): where measured steps went, beside the plan's terms.")] = None,
) -> None:
    """Rebuild report.html from a plan (and its profile); --log adds a run's measurements beside it."""
    from ..costs.layer_costs import Profile
    from ..planner.partitioner import compare_baselines
    from ..planner.plan import Plan
    from ..report.page import write_report

    # The plan's own report.html is what this command rebuilds; any other file is the user's to keep.
    if out is not None and out.exists() and not force:
        raise FileExistsError(f"{out} already exists; pass --force to overwrite it, or choose another --out.")
    plan = Plan.load(plan_path)
    if profile_path is None and (plan_path.parent / "profile.json").exists():
        profile_path = plan_path.parent / "profile.json"
    prof = Profile.load(profile_path) if profile_path is not None else None
    measured = None
    if log is not None:
        from ..report.steplog import compare, read_step_log

        measured = compare(plan, read_step_log(log))
    breakdowns = None
    if breakdown is not None:
        from ..report.breakdown import read_breakdowns

        breakdowns = read_breakdowns(breakdown)
    target = out or plan_path.parent / "report.html"
    if out is None and target.exists() and not force and not _is_autopipe_report(target):
        raise FileExistsError(f"{target} exists and is not an autopipe report; pass --force to overwrite it, or choose --out.")
    from ..cluster.layouts import SearchResult, search_path

    found = search_path(plan_path)
    search = SearchResult.load(str(found)) if found.exists() else None
    baselines = compare_baselines(prof, plan) if prof is not None else None
    write_report(target, plan, prof, baselines=baselines, measured=measured, search=search, breakdowns=breakdowns)
    what = "" if prof is not None else " (no profile: per-layer charts and baselines left out)"
    console.print(f"wrote {target}{what}", highlight=False, soft_wrap=True)
    if measured is not None:
        mem = " ".join(f"{x:.2f}" for x in measured.memory_ratios)
        console.print(f"measured / predicted: step {measured.step_ratio:.2f}, peak memory per rank {mem}",
                      highlight=False, soft_wrap=True)


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@handle_errors
def run_command(
    ctx: typer.Context,
    job: Annotated[Path, typer.Argument(metavar="JOB", help="A job folder autopipe convert wrote (or its train.py).")],
    nproc_per_node: Annotated[Optional[int], typer.Option("--nproc-per-node", help="Processes (default: the plan's stages x replicas).")] = None,
    logs: Annotated[Optional[Path], typer.Option("--logs", help="Where each rank's output goes (default JOB/logs/<time>/).")] = None,
) -> None:
    """Train JOB on this host: one process per stage and replica, on torch's elastic launcher.

    Every flag after JOB goes to train.py (autopipe run jobs/gpt2 --steps 8 --ckpt-every 4). Only
    rank 0's output reaches the terminal, and a failure is its one line; every rank's output is
    kept in a file.
    """
    from ..job.runner import run_job

    status = run_job(job, list(ctx.args), nproc=nproc_per_node, log_dir=logs)
    raise typer.Exit(status)
