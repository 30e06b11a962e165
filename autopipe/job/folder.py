"""The emit pass: Plan + Profile -> a job folder a person launches.

    jobs/gpt2/
      plan.json      where to cut (autopipe.planner.plan.Plan)
      profile.json   what each layer costs (autopipe.costs.layer_costs.Profile)
      train.py       the training script, written by the runtime (autopipe.runtime)
      report.html    the plan explained (autopipe.report)
      README.md      what this job is and how to launch it
      train.sbatch   when the plan spans several nodes: the job under SLURM (autopipe.job.launch)

An existing job folder is refused unless ``force=True``; with force, only the files above are
replaced (a checkpoint folder beside them survives). All files are written into a temporary folder
beside the job folder and moved into it only once every one is written, so a failure leaves the old
job as it was. If anything fails in a folder this call created, the folder is removed again.

Example:
    >>> import tempfile
    >>> from autopipe.costs.layer_costs import Profile
    >>> from autopipe.planner.partitioner import partition
    >>> prof = Profile.from_costs(times=[1.0, 2.0, 2.0, 1.0])
    >>> plan = partition(prof, stages=2)
    >>> settings = JobSettings(model="gpt2", stages=2, microbatches=plan.microbatches, schedule=plan.schedule)
    >>> job = emit(tempfile.mkdtemp() + "/gpt2", settings=settings, profile=prof, plan=plan)
    >>> job.launch.split(" ")[:3], [p.name for p in job.files]
    (['torchrun', '--nproc-per-node', '2'], ['plan.json', 'profile.json', 'train.py', 'report.html', 'README.md'])
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..choices import ENGINES
from ..costs.layer_costs import Profile
from ..errors import AutopipeError
from ..files import write_text_atomic
from ..planner.plan import Plan
from ..report.page import write_report
from .launch import first_run_command, launch_command, sbatch_script
from .readme import job_readme
from .settings import JobSettings

__all__ = ["JobSettings", "JobFiles", "JobExistsError", "JOB_FILES", "emit", "check_job_dir", "launch_command"]

JOB_FILES = ("plan.json", "profile.json", "train.py", "report.html", "README.md")


class JobExistsError(AutopipeError):
    """The job folder already holds files and overwriting was not asked for."""


@dataclass(frozen=True)
class JobFiles:
    """What emit wrote, and the commands that launch it."""

    job_dir: Path
    files: tuple[Path, ...]
    launch: str  # the torchrun line (on several nodes, the one each node runs)
    # the first command to try (launch.first_run_command: a handful of steps under `autopipe run`);
    # "" when the plan spans several nodes, which `autopipe run` (one host) does not launch
    first_run: str = ""


def check_job_dir(job_dir: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Refuse a job folder that already holds files, unless ``force``; refuse a file in its place.

    Called before any expensive pass, so a typo in --out costs nothing.
    """
    path = Path(job_dir)
    if path.exists() and not path.is_dir():
        raise JobExistsError(f"{path} is a file, not a folder; choose another --out.")
    if path.is_dir() and any(path.iterdir()) and not force:
        present = sorted(p.name for p in path.iterdir())
        shown = ", ".join(present[:4]) + (", ..." if len(present) > 4 else "")
        raise JobExistsError(
            f"job folder {path} already exists ({shown}); nothing was changed. "
            "Pass --force to replace its plan, profile, train.py, report and README, or choose another --out."
        )
    return path


def emit(
    job_dir: str | os.PathLike[str],
    *,
    settings: JobSettings,
    profile: Profile,
    plan: Plan,
    baselines: Mapping[str, Plan] | None = None,
    force: bool = False,
    search: Any = None,
) -> JobFiles:
    """Write the job folder for ``plan``: records, train.py, report.html and README.md.

    Args:
        job_dir: the folder to write (created with its parents).
        settings: the model and options train.py rebuilds the job from.
        profile, plan: the records of the profile and partition passes.
        baselines: other partitioners' plans for the report (default: computed from the profile).
        force: replace the job files of an existing folder (other files in it are left alone).
        search: the cluster search's SearchResult when the plan came from one (autopipe.cluster.layout_search):
            saved as plan.search.json and shown in the report.

    Raises:
        JobExistsError: the folder holds files and ``force`` is False.
    """
    if settings.engine not in ENGINES:
        raise AutopipeError(f"unknown engine {settings.engine!r}; use one of {', '.join(ENGINES)}.")
    if len(profile.layers) != plan.num_layers:
        raise AutopipeError(
            f"the plan cuts {plan.num_layers} layers but the profile has {len(profile.layers)}; "
            "partition this profile again."
        )
    path = check_job_dir(job_dir, force=force)
    # The topmost folder this call creates (jobs/ itself on a first run): removed again on failure.
    created = next((p for p in reversed([path, *path.parents]) if not p.exists()), None)
    path.mkdir(parents=True, exist_ok=True)
    # Every file is written into a staging folder beside the job first and moved in only when all are
    # written: a failure midway (with --force) leaves the old job whole, not half old and half new.
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        # train.py first: the step most likely to refuse (engine, model source), before the rest is written.
        _write_train_script(staging, settings, plan)
        plan.save(staging / "plan.json")
        profile.save(staging / "profile.json")
        write_report(staging / "report.html", plan, profile, baselines=baselines, title=settings.model, search=search)
        dp, nodes = plan.dp, plan.nodes
        launch = launch_command(path, settings, dp, nodes, tp=getattr(plan, "tp", 1))
        first = first_run_command(path) if nodes == 1 else ""
        write_text_atomic(staging / "README.md", job_readme(settings, profile, plan, launch, first_run=first))
        names = JOB_FILES
        if nodes > 1:  # the same job under SLURM, one torchrun per node
            names = (*names, "train.sbatch")
            write_text_atomic(staging / "train.sbatch", sbatch_script(path, settings, dp=dp, nodes=nodes,
                                                                      placement=plan.placement, tp=getattr(plan, "tp", 1)))
        if search is not None:
            names = (*names, "plan.search.json")
            search.save(str(staging / "plan.search.json"))
        if plan.target:  # planned for another trainer: what it reads, beside the plan (autopipe export)
            from .export import default_filename, export_plan

            # the engine's own file name: torchtitan 0.3 imports it as a module (--module autopipe_plan)
            name = default_filename(plan.target)
            exported = export_plan(plan, profile, plan.target, path=path / name)
            names = (*names, name)
            write_text_atomic(staging / name, exported.text)
        if settings.engine == "deepspeed":  # DeepSpeed's own settings file, for the user to edit
            names = (*names, "ds_config.json")
            write_text_atomic(staging / "ds_config.json", _ds_config(settings, plan))
        for name in names:
            os.replace(staging / name, path / name)
    except BaseException:
        if created is not None:  # leave no half-made job behind (never a folder the user had)
            shutil.rmtree(created, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return JobFiles(path, tuple(path / name for name in names), launch, first)


def _ds_config(settings: JobSettings, plan: Plan) -> str:
    import json

    from ..runtime.deepspeed_engine.settings import ds_config
    from ..runtime.training.optim import TrainConfig

    # the plan's ZeRO stage (0 or 1 on DeepSpeed: convert refuses more) is the job's
    config = TrainConfig(microbatches=settings.microbatches, dtype=settings.dtype, seed=settings.seed,
                         zero=plan.zero, optimizer=settings.optimizer, lr=settings.lr,
                         weight_decay=settings.weight_decay, betas=tuple(settings.betas), momentum=settings.momentum,
                         warmup=settings.warmup, lr_schedule=settings.lr_schedule, grad_clip=settings.grad_clip)
    made = ds_config(config, rows=settings.batch_size, dp=1)
    if settings.ds_config is not None:  # the user's own config, with the plan's pipeline keys over it
        from .ds_config import merge_ds_config, read_ds_config

        made = merge_ds_config(read_ds_config(settings.ds_config), made)
    return json.dumps(made, indent=2) + "\n"


def _write_train_script(job_dir: Path, settings: JobSettings, plan: Plan) -> Path:
    """train.py, from the runtime's template (autopipe.job.script) with this job's settings."""
    from .script import write_train_script

    return write_train_script(job_dir / "train.py", settings, plan)
