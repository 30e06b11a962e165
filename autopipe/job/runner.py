"""``autopipe run JOB [train.py flags]``: a job's processes on torch's own elastic launcher, quietly.

torchrun starts the same processes, but a failure there is the job's one line followed by 30-50
lines of torchrun's own report (``ChildFailedError``, a table per rank), every rank prints what it
prints, and torchrun warns about ``OMP_NUM_THREADS`` on every launch. ``run_job`` starts the
processes through ``torch.distributed.launcher.api.elastic_launch`` (what torchrun calls; c10d
rendezvous on this host, as ``torchrun --standalone``) and:

- sends every rank's stdout and stderr to a file, ``JOB/logs/<time>/<run>/attempt_0/<rank>/``
  (``stdout.log``, ``stderr.log``), and copies rank 0's to the terminal as they are written: the
  progress lines, and on a failure the one ``error:`` line rank 0 prints for every rank;
- keeps the launcher's own messages in ``launcher.log`` there, off the terminal;
- on Ctrl-C stops every rank (rank 0 prints the newest checkpoint and the command that resumes:
  ``autopipe run JOB ... --resume``) and exits 130; on a failure exits 1, adding one line only when
  no rank said why (a rank killed by a signal), naming its log file.

The process count is the plan's (stages x replicas; ``--dp`` among the flags counts), or
``--nproc-per-node``. A plan for several nodes is launched per node with its torchrun line or
``train.sbatch`` (the job's README).
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Sequence, TextIO

from ..errors import AutopipeError

__all__ = ["job_script", "run_job"]


def job_script(job: str | os.PathLike[str]) -> Path:
    """The train.py of ``job`` (a job folder, or its train.py), or a one-line error."""
    path = Path(job)
    script = path / "train.py" if path.is_dir() else path
    if not script.is_file():
        what = "has no train.py" if path.is_dir() else "does not exist"
        raise AutopipeError(f"{job} {what}; give a job folder autopipe convert wrote (or its train.py).")
    return script


def _processes(script: Path, flags: Sequence[str]) -> int:
    """stages x replicas x tp: the plan's stages, the replicas of ``--dp`` (and the tp ranks of ``--tp``) among
    the flags, else the plan's.
    The plan is read as train.py reads it: a hand-written ``{"boundaries": [...]}`` too."""
    from ..planner.plan import load_plan

    plan_path = script.with_name("plan.json")
    given = _flag(flags, "--plan")
    if given not in (None, "even"):
        plan_path = Path(given)
    if not plan_path.is_file():
        raise AutopipeError(f"{plan_path} does not exist; give --nproc-per-node N to autopipe run.")
    plan = load_plan(plan_path)
    if plan.nodes > 1:
        raise AutopipeError(f"{plan_path} spans {plan.nodes} nodes; launch each node with the torchrun line in "
                            f"{script.with_name('README.md')} (or sbatch {script.with_name('train.sbatch')}).")
    dp = _flag(flags, "--dp")
    try:
        replicas = int(dp) if dp is not None else plan.dp
    except ValueError:
        raise AutopipeError(f"--dp {dp}: give a whole number of replicas.") from None
    tp = _flag(flags, "--tp")
    try:
        per_stage = int(tp) if tp is not None else getattr(plan, "tp", 1)
    except ValueError:
        raise AutopipeError(f"--tp {tp}: give a whole number of tensor-parallel ranks.") from None
    # a hand-written cut of no stage count (no stage_ranks): one chunk per stage
    return (plan.stages or plan.num_chunks) * replicas * per_stage


def _preflight(script: Path, flags: Sequence[str], processes: int) -> None:
    """train.py's own first checks (its flags, its checkpoint folder, --resume, the plan against the
    process count, the data files: ``rt.preflight``), run here on its Settings before launching;
    a train.py without a Settings class (written before it) checks them itself."""
    from ..runtime.process.flags import read_flags
    from ..runtime.training.preflight import preflight
    from .script import load_settings

    settings = load_settings(script)
    if settings is not None:
        preflight(read_flags(settings, list(flags)), world=processes)


def _flag(flags: Sequence[str], name: str) -> str | None:
    """The value of ``name`` in ``flags`` (``--dp 2`` or ``--dp=2``), the last one given, or None."""
    value = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def run_job(job: str | os.PathLike[str], flags: Sequence[str] = (), *, nproc: int | None = None,
            log_dir: str | os.PathLike[str] | None = None, out: TextIO | None = None,
            err: TextIO | None = None) -> int:
    """Launch ``job``'s train.py with ``flags`` on this host (see the module docstring); returns the
    exit status (0, 1, or 130 after Ctrl-C)."""
    out, err = out or sys.stdout, err or sys.stderr
    script = job_script(job)
    n = nproc or _processes(script, flags)
    _preflight(script, flags, n)  # a mistake that needs no model: said now, before any process starts
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from ..runtime.process.launch import RUN_COMMAND

    logs = Path(log_dir) if log_dir is not None else script.parent / "logs" / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    quiet = _launcher_log(logs / "launcher.log")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for its workers (it warns; we say it here)
    os.environ[RUN_COMMAND] = shlex.join(["autopipe", "run", str(job)])  # the resume line a stopped run prints
    print(f"autopipe run: {n} process(es) of {script}; each rank's output in {logs}/", file=out, flush=True)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=f"autopipe-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL))
    done = threading.Event()
    said: list[str] = []
    tails = [threading.Thread(target=_tail, args=(logs, name, dst, done, said), daemon=True)
             for name, dst in (("stdout.log", out), ("stderr.log", err))]
    for t in tails:
        t.start()
    status, failed = 0, None
    try:
        elastic_launch(config, entrypoint=sys.executable)(str(script), *flags)
    except ChildFailedError as e:
        status, failed = 1, e
    except KeyboardInterrupt:
        status = 130
    except Exception as e:  # the agent's SignalException (SIGTERM, SIGHUP) and its kin: a stop
        status = 130 if type(e).__name__ == "SignalException" else 1
        if status == 1:
            raise
    finally:
        done.set()
        for t in tails:
            t.join(timeout=10)
        quiet()
    held = [line for line in said if line.startswith("error:")]  # rank 0's error lines, held back by _tail
    # a negative exit code is the signal that ended the process (torch's ProcessFailure.signal_name)
    killed = sorted(((r, f) for r, f in failed.failures.items() if f.exitcode < 0), key=lambda rf: rf[0]) \
        if failed is not None else []
    if failed is not None and (killed or not any(line.startswith(("error:", "interrupted:")) for line in said)):
        # a rank killed by a signal is the cause; rank 0's error is then only its lost connection
        rank, failure = killed[0] if killed else min(failed.failures.items(), key=lambda rf: rf[0])
        why = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"error: rank {rank} stopped ({why}) without a word; its output: {_rank_dir(logs, rank)}",
              file=err, flush=True)
    else:
        err.writelines(held)
        err.flush()
    return status


def _rank_dir(logs: Path, rank: int) -> Path:
    found = sorted(logs.glob(f"*/attempt_*/{rank}"))
    return found[-1] if found else logs


def _tail(logs: Path, name: str, dst: TextIO, done: threading.Event, said: list[str]) -> None:
    """Copy rank 0's ``name`` (stdout.log or stderr.log) to ``dst`` as it grows, until the run is
    done and the file read to its end."""
    path = None
    while path is None:
        found = sorted(logs.glob(f"*/attempt_*/0/{name}"))
        if found:
            path = found[-1]
        elif done.is_set():
            return
        else:
            time.sleep(0.1)
    with open(path, errors="replace") as f:
        while True:
            line = f.readline()
            if line:
                said.append(line)
                if not line.startswith("error:"):  # said at the end, once it is known which rank failed first
                    dst.write(line)
                    dst.flush()
            elif done.is_set():
                return
            else:
                time.sleep(0.1)


def _launcher_log(path: Path) -> Callable[[], None]:
    """Send the elastic launcher's own messages (rendezvous, worker exits) to ``path`` instead of
    the terminal; returns the function that puts things back."""
    logger = logging.getLogger("torch.distributed.elastic")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    before = (logger.propagate, logger.level)
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)

    def restore() -> None:
        logger.removeHandler(handler)
        handler.close()
        logger.propagate, level = before
        logger.setLevel(level)

    return restore
