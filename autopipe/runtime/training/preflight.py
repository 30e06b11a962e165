"""What a run can be refused for before any model is built: checked in the first second.

Building the model (on the meta device) and tracing it takes seconds to minutes; importing torch
alone a second or two. A mistake that needs no model (a checkpoint folder holding another run's,
``--resume`` with nothing to resume, a plan whose stage count the processes launched do not fit,
a data file that is not there) is said first, in one line, from rank 0: ``preflight`` runs
before any of that, and imports no torch.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from ...errors import AutopipeError
from ...planner.plan import load_plan
from ...planner.stage_plan import StagePlan
from ..checkpoints.folders import check_ckpt_dir, latest_checkpoint, saved_steps
from ..checkpoints.resume import ResumeError
from ..data.files import check_data_path
from ..process.lifecycle import check_launch

__all__ = ["preflight"]


def preflight(settings: Any, *, world: int | None = None) -> StagePlan | None:
    """Refuse, in one line, what a train.py run can be refused for without its model; returns the
    plan it read (None for ``plan = 'even'``).

    ``settings`` is train.py's (its ``Settings``): ``ckpt_dir``, ``ckpt_every``, ``resume``,
    ``plan``, ``dp``, ``engine``, ``data``, ``eval_data``. ``world``: the processes launched
    (default torchrun's ``WORLD_SIZE``; one when run with plain python); ``autopipe run`` asks
    before it launches them.
    """
    check_ckpt_dir(settings.ckpt_dir, resume=settings.resume, saving=settings.ckpt_every > 0)
    if settings.resume == "must" and not _has_checkpoint(Path(settings.ckpt_dir), settings.engine):
        raise ResumeError(f"--resume: no checkpoint in {settings.ckpt_dir}; check --ckpt-dir, or use --resume auto to "
                          "start afresh when there is none.")
    for flag, value in (("--data", settings.data), ("--eval-data", settings.eval_data)):
        if value is not None:  # every source a job reads is a file; synthetic data is None
            check_data_path(Path(value), flag=flag)
    plan = None if str(settings.plan) == "even" else load_plan(settings.plan)
    in_job = world is None  # train.py's own check, not autopipe run's before it launches
    world = world if world is not None else int(os.environ.get("WORLD_SIZE", "1"))
    dp = int(settings.dp)
    tp = int(getattr(settings, "tp", 1) or 1) if world > 1 else 1  # one process runs the plan whole
    if tp > 1 and settings.engine == "deepspeed":
        raise AutopipeError(f"--tp {tp} on DeepSpeed: its PipelineModule runs no tensor parallelism here; use "
                            "--engine torch for --tp, or --tp 1.")
    if tp > 1 and (world % tp or tp < 1):
        raise AutopipeError(f"world size {world} is not a multiple of --tp {tp}; launch stages x dp x tp processes.")
    if dp < 1 or world % (dp * tp):
        raise AutopipeError(f"world size {world} is not a multiple of --dp {dp}{f' x --tp {tp}' if tp > 1 else ''}; "
                            f"launch dp x stages{' x tp' if tp > 1 else ''} processes.")
    _check_ep(settings, dp, tp, world)
    if getattr(settings, "sequence_parallel", False) and world > 1:
        if tp == 1:
            raise AutopipeError("--sequence-parallel shards the activations over the tp ranks of a stage: it needs "
                                "--tp 2 or more; add --tp, or drop --sequence-parallel.")
    if plan is not None:
        check_launch(plan, world // (dp * tp), dp, plan_path=str(settings.plan), tp=tp)
        sp = bool(getattr(settings, "sequence_parallel", False)) and tp > 1
        said = plan_mismatch(plan, tp, sp, plan_path=str(settings.plan)) if world > 1 else None  # one process: whole
        if said and in_job and os.environ.get("RANK", "0") == "0":  # said once, by the job's rank 0
            warnings.warn(said, stacklevel=2)
    return plan


def plan_mismatch(plan: StagePlan, tp: int, sequence_parallel: bool, *, plan_path: str = "plan.json") -> str | None:
    """One line when a run's tp degree or sequence parallelism differs from what its plan was priced for
    (the cut still runs, its step and memory predictions do not hold); None when they agree.

    Example:
        >>> plan_mismatch(StagePlan((0, 2, 4), stages=2, microbatches=4, tp=2, sequence_parallel=True), 2, False)[:64]
        'plan.json was priced for tp 2 with --sequence-parallel, this run'
        >>> plan_mismatch(StagePlan((0, 2, 4), stages=2, microbatches=4, tp=2), 2, False) is None
        True
    """
    if not plan.microbatches:  # a hand-written cut: priced for nothing
        return None
    planned_sp = bool(plan.sequence_parallel) and plan.tp > 1
    if plan.tp == tp and planned_sp == sequence_parallel:
        return None
    fix = (f"--tp {plan.tp}" + (" --sequence-parallel" if planned_sp else "")) if plan.tp > 1 else "--tp 1"
    return (f"{plan_path} was priced for {_degree(plan.tp, planned_sp)}, this run has {_degree(tp, sequence_parallel)}: "
            f"the cut runs, its predicted step and memory do not hold; launch with {fix}, or re-plan at this layout.")


def _degree(tp: int, sequence_parallel: bool) -> str:
    return f"tp {tp}" + (" with --sequence-parallel" if sequence_parallel else "")


def _check_ep(settings: Any, dp: int, tp: int, world: int) -> None:
    """Expert parallelism's one-line refusals (autopipe.runtime.stage.expert_parallel): what it does
    not compose with yet, before any model is built."""
    ep = int(getattr(settings, "ep", 1) or 1) if world > 1 else 1
    if ep == 1:
        return
    if ep < 1 or dp % ep:
        raise AutopipeError(f"--ep {ep} must divide --dp {dp}: the experts are shared out over ep of a stage's "
                            "replicas; pick an ep that divides dp (or --ep 1).")
    if settings.engine == "deepspeed":
        raise AutopipeError(f"--ep {ep} on DeepSpeed: its PipelineModule runs no expert parallelism here; use --engine "
                            "torch for --ep, or --ep 1.")


def _has_checkpoint(root: Path, engine: str) -> bool:
    """Whether ``root`` holds a checkpoint the engine resumes from (DeepSpeed's tags are its own)."""
    return bool(saved_steps(root)) if engine == "deepspeed" else latest_checkpoint(root) is not None

