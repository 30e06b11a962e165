"""The job folder's README.md: what the job is, how to launch it, and the plan in one table."""

from __future__ import annotations

import shlex

from ..costs.layer_costs import Profile
from ..planner.plan import Plan
from ..report.predicted import step_text
from ..units import format_bytes, format_microbatch, format_time
from .launch import FIRST_STEPS
from .settings import JobSettings

__all__ = ["job_readme"]


def _data_line(settings: JobSettings) -> str:
    data = f"`{settings.data}`" if settings.data else "synthetic data (`--data` for yours)"
    return f"{data}, loss `{settings.loss}`"


def _launch_lines(launch: str, first_run: str, plan: Plan) -> str:
    """The commands, the first to try first: ``autopipe run JOB --steps N`` (one host), then torchrun."""
    if not first_run:
        return f"    {launch}\n"
    return (f"A first run of {FIRST_STEPS} steps (about {format_time(FIRST_STEPS * plan.predicted_step)} by the plan's "
            f"step, after a start-up); rank 0's output on the terminal, every rank's log kept:\n\n    {first_run}\n\n"
            f"or torch's launcher itself (every flag after train.py reaches it; `--steps 100` is its default):\n\n"
            f"    {launch}\n")


def _tp_words(plan: Plan) -> str:
    tp = getattr(plan, "tp", 1)
    if tp <= 1:
        return ""
    return (f"\nTensor parallelism {tp} inside each stage: {plan.stages} stages x {plan.dp} replicas x tp {tp} = "
            f"{plan.stages * plan.dp * tp} processes (nproc = stages x dp x tp), a stage's tp ranks consecutive on one node.")


def job_readme(settings: JobSettings, profile: Profile, plan: Plan, launch: str, *, first_run: str = "") -> str:
    """The README's markdown for ``plan`` of ``profile``, launched by ``launch`` (the torchrun line),
    with ``first_run`` (``autopipe run JOB --steps N``) as the command to try first where given."""
    rows = []
    for c in range(plan.num_chunks):
        a, b = plan.boundaries[c], plan.boundaries[c + 1]
        first = profile.layers[a].name or f"layer{a}"
        last = profile.layers[b - 1].name or f"layer{b - 1}"
        rows.append(f"| {c} | {plan.stage_ranks[c]} | {a}–{b - 1} (`{first}` … `{last}`) | "
                    f"{format_time(plan.stage_times[c])} | {format_bytes(plan.stage_memory[c])} |")
    limit = format_bytes(plan.memory_limit) if plan.memory_limit else "none"
    nodes = plan.nodes
    where = "" if nodes == 1 else f"""
The plan spans {nodes} nodes of {plan.gpus_per_node} ({plan.stages} stages x {plan.dp} replicas, ranks
numbered {plan.placement}). Run the line on every node, with `NODE_RANK` set to 0 .. {nodes - 1} and
`MASTER_ADDR` to node 0's address; or, under SLURM, `sbatch train.sbatch` (flags after it reach
train.py: `sbatch train.sbatch --resume`). The checkpoint folder (`--ckpt-dir`) must be on a
filesystem every node mounts: the first save checks it.
"""
    return f"""# Pipeline job: {settings.model}

Made by `autopipe convert` from {profile.mode} costs on {profile.device.name} ({profile.dtype}),
micro-batch {format_microbatch(profile.microbatch)}. {plan.stages} stages, schedule {plan.schedule},
{plan.microbatches} micro-batches per step, memory limit {limit}, engine {settings.engine}.{_schedule_words(plan)}{_tp_words(plan)}

## Launch

The model is rebuilt from `{settings.model}` on every rank; the job trains on {_data_line(settings)}.
{_launch_lines(launch, first_run, plan)}{where}
`python {shlex.quote(shlex.split(launch)[-1])} --help` lists the training options; one process (`python train.py`)
runs every stage in turn, for debugging.

## The plan

Predicted step time {step_text(plan)}, bubble {plan.bubble_fraction:.0%},
slowest stage / mean {plan.balance:.2f}, peak memory {format_bytes(plan.peak_memory)}.

| stage | rank | layers | time per micro-batch | memory |
| --- | --- | --- | --- | --- |
{chr(10).join(rows)}

Open `report.html` for the per-layer costs, the baselines and the schedule timeline.

## Files

- `plan.json`: where to cut; `autopipe report plan.json` rebuilds `report.html` from it.
- `profile.json`: what each layer costs; `autopipe plan` can cut it again for other stage counts.
- `train.py`: the training script (settings at the top).{chr(10) + "- `train.sbatch`: the job under SLURM, one torchrun per node." if nodes > 1 else ""}
"""


def _schedule_words(plan: Plan) -> str:
    """How the schedule was chosen, when auto chose it: each candidate's predicted whole step."""
    if plan.schedule_policy != "auto":
        return ""
    steps = ", ".join(f"{s} {format_time(t)}" for s, t in plan.schedule_steps.items())
    how = (f"the simplest (fewest chunks, micro-batches held and sends) within {plan.schedule_margin:.0%} of the fastest"
           if plan.schedule_margin > 0 else "the fastest")
    return f"\nThe schedule is {how} predicted whole step of those planned (`--schedule auto`): {steps}."

