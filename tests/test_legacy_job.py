"""A job folder people already have keeps training after an upgrade, and trains the same.

tests/fixtures/job_d5ffd7b/ was written by ``autopipe convert llama-tiny --stages 2 --seq-len 16
--microbatches 2`` before the package moved into pass folders (its README). Its train.py names
``autopipe.runtime`` as it was then. Copied to a temporary folder, it trains 2 steps in one process
and on 2 under torchrun, and its losses equal those of the same job written by today's
``write_train_script`` beside the same plan.json, run the same way.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from _launch import Launcher

from autopipe.job import write_train_script
from autopipe.planner.plan import Plan

pytestmark = pytest.mark.slow  # each test trains two jobs in processes of their own

LEGACY = Path(__file__).parent / "fixtures" / "job_d5ffd7b"
STEPS = 2


def _today(folder: Path) -> Path:
    """The fixture's job as today's code writes it: its settings (the legacy train.py's header), its plan."""
    folder.mkdir()
    shutil.copy(LEGACY / "plan.json", folder / "plan.json")
    write_train_script(folder / "train.py", model="llama-tiny", stages=2, microbatches=2, schedule="1f1b",
                       plan=Plan.load(folder / "plan.json"), batch_size=1, seq_len=16, dtype="fp32", engine="torch",
                       seed=0, loss="auto", data=None)
    return folder


def _losses(torchrun: Launcher, job: Path, nproc: int) -> list[float]:
    torchrun(job / "train.py", "--steps", STEPS, "--log-json", job / "log.json", nproc=nproc, cwd=job)
    log = [json.loads(line) for line in (job / "log.json").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    return [r["loss"] for r in log]


@pytest.mark.distributed
def test_a_job_written_before_the_move_trains_as_today_s_does(torchrun: Launcher, tmp_path: Path) -> None:
    """torchrun on 2 processes: the old folder trains, and its per-step losses equal today's job's
    exactly (same plan, same seed, same runtime). (The one-process run of a job is test_zoo's.)"""
    nproc = 2
    legacy = tmp_path / "legacy"
    shutil.copytree(LEGACY, legacy)
    old = _losses(torchrun, legacy, nproc)
    new = _losses(torchrun, _today(tmp_path / "today"), nproc)
    assert old == new
    assert all(loss > 0 for loss in old)
