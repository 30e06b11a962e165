"""How a job folder is launched: the torchrun line, and on several nodes a SLURM batch script.

A plan spans several nodes when its world (stages x replicas) is larger than its ``gpus_per_node``
(the cluster search's, or ``convert --gpus-per-node``). torchrun then runs once per node with
``--nnodes``; the README's line uses a static rendezvous (each node's ``--node-rank`` and node 0's
address), which a person types on each node; ``train.sbatch`` uses torchrun's c10d rendezvous at
the first node of the allocation, one torchrun per node started by ``srun``. Either way torchrun
numbers the ranks node by node, which is what the plan's placement assumes: the ranks of one node
are consecutive.

Example:
    >>> from autopipe.job.settings import JobSettings
    >>> settings = JobSettings(model="gpt2", stages=8, microbatches=16, schedule="1f1b")
    >>> launch_command("jobs/gpt2", settings, dp=2, nodes=2)
    'torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR --master-port 29500 jobs/gpt2/train.py'
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ..errors import AutopipeError
from .settings import JobSettings

__all__ = ["FIRST_STEPS", "RDZV_PORT", "first_run_command", "launch_command", "sbatch_script"]

RDZV_PORT = 29500  # torchrun's default master port; MASTER_PORT in the environment overrides it in train.sbatch
# Steps of the first run convert suggests: a handful, so that it ends in about a minute where train.py's
# default 100 steps took 8-40 minutes for GPT-2 on 2 CPU cores (issue 41), and past the first step
# (which also builds the schedule) so the log shows steady steps beside the plan's.
FIRST_STEPS = 8


def _per_node(settings: JobSettings, dp: int, nodes: int, tp: int = 1) -> int:
    world = settings.stages * dp * tp
    if nodes < 1 or world % nodes:
        raise AutopipeError(f"{world} processes (stages x dp{' x tp' if tp > 1 else ''}) cannot be spread evenly over "
                            f"{nodes} nodes.")
    return world // nodes


def launch_command(job_dir: str | os.PathLike[str], settings: JobSettings, dp: int = 1, nodes: int = 1, tp: int = 1) -> str:
    """The command that starts training: torchrun with one process per stage and replica, for either
    engine (DeepSpeed's engine runs under torchrun too, so the command needs nothing beyond torch);
    train.py takes the replica count (and ZeRO stage, and placement) from the plan. On several nodes,
    the line to run on each of them, with ``NODE_RANK`` (0 .. nodes-1) and ``MASTER_ADDR`` (node 0's
    address) set in its shell. ``tp``: tensor-parallel ranks per stage (processes = stages x dp x tp)."""
    script = shlex.quote(str(Path(job_dir) / "train.py"))
    per = _per_node(settings, dp, nodes, tp)
    if nodes == 1:
        return f"torchrun --nproc-per-node {per} {script}"
    return (f"torchrun --nnodes {nodes} --nproc-per-node {per} --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
            f"--master-port {RDZV_PORT} {script}")


def first_run_command(job_dir: str | os.PathLike[str], steps: int = FIRST_STEPS) -> str:
    """The first command to try a one-host job with: ``autopipe run JOB --steps N``, torch's
    launcher under autopipe's (rank 0's output on the terminal, every rank's log kept, a failure
    in one line), a handful of steps.

    >>> first_run_command("jobs/gpt2")
    'autopipe run jobs/gpt2 --steps 8'
    """
    return f"autopipe run {shlex.quote(str(job_dir))} --steps {int(steps)}"


def sbatch_script(job_dir: str | os.PathLike[str], settings: JobSettings, *, dp: int, nodes: int,
                  placement: str = "pipeline-inner", tp: int = 1) -> str:
    """``train.sbatch``: the job on ``nodes`` nodes under SLURM (``sbatch train.sbatch [train.py flags]``).

    One task per node runs torchrun, which starts that node's ranks; the flags given to sbatch after
    the script's name reach train.py (``--steps 1000``, ``--resume``). GPUs are requested per node
    unless the job was profiled on a CPU.

    Example:
        >>> from autopipe.job.settings import JobSettings
        >>> text = sbatch_script("/jobs/gpt2", JobSettings(model="gpt2", stages=8, microbatches=16,
        ...                      schedule="1f1b", device="cuda"), dp=2, nodes=2)
        >>> [line for line in text.splitlines() if line.startswith(("#SBATCH --nodes", "#SBATCH --gpus"))]
        ['#SBATCH --nodes=2', '#SBATCH --gpus-per-node=8']
    """
    per = _per_node(settings, dp, nodes, tp)
    script = shlex.quote(str(Path(job_dir).resolve() / "train.py"))
    name = "".join(c if c.isalnum() or c in "-_." else "-" for c in Path(settings.model).name) or "job"
    gpus = [f"#SBATCH --gpus-per-node={per}"] if settings.device != "cpu" else []
    lines = [
        "#!/bin/bash",
        f"# {settings.model}: {settings.stages} stages x {dp} replicas{f' x tp {tp}' if tp > 1 else ''} = "
        f"{settings.stages * dp * tp} processes, "
        f"{per} on each of {nodes} nodes (ranks {placement}).",
        "# Submit with: sbatch train.sbatch [train.py flags, e.g. --steps 1000, or --resume]",
        f"#SBATCH --job-name=autopipe-{name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *gpus,
        "#SBATCH --output=autopipe-%j.out",
        "set -euo pipefail",
        "",
        "# node 0 of the allocation hosts torchrun's rendezvous; each node's torchrun starts its ranks there,",
        "# numbered node by node (what the plan's placement assumes). The checkpoint folder (--ckpt-dir, default",
        "# beside train.py) must be on a filesystem every node mounts.",
        'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f'srun torchrun --nnodes "$SLURM_NNODES" --nproc-per-node {per} --rdzv-backend c10d \\',
        f'    --rdzv-endpoint "$head:${{MASTER_PORT:-{RDZV_PORT}}}" --rdzv-id "$SLURM_JOB_ID" {script} "$@"',
        "",
    ]
    return "\n".join(lines)
