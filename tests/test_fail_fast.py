"""Mistakes that need no model are said before the model is built: by train.py (under torchrun or
python) and by ``autopipe run`` before it launches a process, and by ``convert`` before it traces.

The model's factory here leaves a file behind when it is called, so each test sees that the one
error line came with the model never built (how long that takes is bench/bench_fail_fast.py's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autopipe.job.script import write_train_script
from autopipe.job.settings import JobSettings

AUTOPIPE = [sys.executable, "-m", "autopipe"]

FACTORY = '''
from pathlib import Path
import torch
from torch import nn

def build(batch_size=2):
    Path(__file__).with_name("built").write_text("the factory ran")
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)), (torch.randn(batch_size, 4),)
'''


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A 2-stage job over a factory that marks its file when it builds the model (the plan's chunks
    written by hand: no profile, so nothing has called the factory yet)."""
    (tmp_path / "net.py").write_text(FACTORY)
    folder = tmp_path / "job"
    folder.mkdir()
    write_train_script(folder, JobSettings(model=f"{tmp_path / 'net.py'}:build", stages=2, microbatches=2,
                                           schedule="1f1b", batch_size=2, loss="mse"))  # fmt: skip
    plan = {"boundaries": [0, 2, 3], "stage_ranks": [0, 1]}
    (folder / "plan.json").write_text(json.dumps(plan))
    other = folder / "other-run" / "step_00000004"
    other.mkdir(parents=True)
    (other / "meta.json").write_text("{}")  # a folder another run saved into
    return folder


BAD = [
    (["--resume"], "--resume: no checkpoint in"),
    (["--data", "missing.bin"], "--data 'missing.bin' does not exist."),
    (["--eval-data", "held-out.npz"], "--eval-data 'held-out.npz' does not exist."),
    (["--stpes", "3"], "unknown flag --stpes; did you mean --steps?"),
    (["--ckpt-dir", "other-run", "--ckpt-every", "1"], "holds another run's checkpoints (step 4)"),
    (["--dtype", "fp8"], "invalid choice: 'fp8'"),
]


def _one_line(done: subprocess.CompletedProcess, expected: str, job: Path) -> None:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:") and expected in lines[0], done.stderr[-2000:]
    assert not (job.parent / "built").exists(), "the model was built before the error was said"


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "expected"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_train_py_says_it_before_building_the_model(job: Path, flags: list[str], expected: str) -> None:
    """python train.py: each mistake is one line, exit 1, and the factory never ran."""
    done = subprocess.run([sys.executable, "train.py", *flags], cwd=job, capture_output=True, text=True, timeout=120)
    _one_line(done, expected, job)


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "expected"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_autopipe_run_says_it_before_launching_a_process(job: Path, flags: list[str], expected: str) -> None:
    """autopipe run JOB: the same line, before any rank starts (no log folder is made)."""
    done = subprocess.run([*AUTOPIPE, "run", str(job), *flags], cwd=job, capture_output=True, text=True, timeout=120)
    _one_line(done, expected, job)
    assert not (job / "logs").exists()


@pytest.mark.slow
def test_a_process_count_the_plan_does_not_fit_is_said_before_the_model(job: Path, torchrun) -> None:
    """3 processes for a 2-stage plan: under autopipe run before launching, under torchrun before any
    rank builds the model; both name the count that fits."""
    done = subprocess.run([*AUTOPIPE, "run", str(job), "--nproc-per-node", "3"], cwd=job, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    _one_line(done, "launch with --nproc-per-node 2", job)
    ranks = torchrun(job / "train.py", nproc=3, cwd=job, check=False, timeout=120)
    _one_line(ranks, "launch with --nproc-per-node 2", job)


@pytest.mark.slow
def test_convert_says_a_folder_or_data_mistake_before_tracing(job: Path, tmp_path: Path) -> None:
    """convert into a job folder without --force, or with --data that is not there: one line, the
    factory never called."""
    factory = f"{tmp_path / 'net.py'}:build"
    done = subprocess.run([*AUTOPIPE, "convert", factory, "--stages", "2", "--out", str(job), "--loss", "mse"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    _one_line(done, "already exists", job)
    done = subprocess.run([*AUTOPIPE, "convert", factory, "--stages", "2", "--out", str(tmp_path / "new"),
                           "--data", "missing.bin", "--loss", "mse"], capture_output=True, text=True, timeout=120)
    _one_line(done, "--data 'missing.bin' does not exist.", job)
