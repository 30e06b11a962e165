"""A mistake says what was meant: model names, factory functions and flags ("did you mean"), job
folders named after the factory so that the real problem shows, data too small for a step, and a
memory limit that the advice says fits does fit.

Before: `skip.py:branchy` and `alex.py:biuld` both stopped at "job folder jobs/skip|alex already
exists"; `gtp2` had no suggestion; 8 samples for a 32-row step trained without a word; the advice
under --memory-limit 30MiB was "13.84 MiB per device fits 2 stages", below the runtime's own 22.89 MiB.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _factories import tiny_gpt2_job
from _launch import Launcher
from typer.testing import CliRunner

from autopipe.cli import app
from autopipe.errors import AutopipeError, InfeasibleMemoryError
from autopipe.units import parse_size

FACTORIES = '''
import torch
from torch import nn


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # a branch on the data: torch.export cannot trace it
            return self.a(x).sum()
        return self.b(x).sum()


def build(batch_size=2):
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), (torch.randn(batch_size, 4),)


def branchy(batch_size=2):
    return Branchy(), (torch.randn(batch_size, 4),)


if __name__ == "__main__":
    print(build())
'''


@pytest.fixture()
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "alex.py").write_text(FACTORIES)
    return tmp_path


def _error(result) -> str:  # noqa: ANN001
    lines = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(lines) == 1, result.output
    return lines[0]


def test_job_folders_are_named_after_the_factory_and_a_misspelled_one_says_what_was_meant(here: Path) -> None:
    """alex.py:biuld says 'did you mean build?' even where a job folder of that name exists (the model is
    found first, reading the file, not running it); alex.py:branchy goes to jobs/alex-branchy, so an
    existing jobs/alex-build does not hide that its forward branches on the data."""
    from autopipe.job.converter import default_job_dir

    assert default_job_dir("alex.py:branchy") == Path("jobs/alex-branchy")
    (here / "jobs" / "alex-biuld").mkdir(parents=True)
    (here / "jobs" / "alex-biuld" / "plan.json").write_text("{}")
    (here / "jobs" / "alex-build").mkdir()
    (here / "jobs" / "alex-build" / "plan.json").write_text("{}")
    runner = CliRunner()
    line = _error(runner.invoke(app, ["convert", "alex.py:biuld", "--stages", "2", "--estimate"]))
    assert line == "error: alex.py has no function 'biuld'. Did you mean build?"
    line = _error(runner.invoke(app, ["convert", "alex.py:branchy", "--stages", "2", "--estimate"]))
    assert "already exists" not in line and "jobs/alex-branchy" not in line
    assert re.search(r"branch|data-dependent|control flow", line, re.I), line
    assert not (here / "jobs" / "alex-branchy").exists()


def test_an_unknown_model_name_and_a_misspelled_flag_name_what_was_meant(here: Path) -> None:
    runner = CliRunner()
    line = _error(runner.invoke(app, ["convert", "gtp2", "--stages", "2"]))
    assert line.endswith("Did you mean gpt2?")
    result = runner.invoke(app, ["convert", "gpt2", "--stagse", "2"])  # click's own suggestion
    assert result.exit_code == 2 and "--stagse" in result.output and "--stages" in result.output


def test_data_too_small_for_a_step_is_a_warning_with_the_numbers(tmp_path: Path) -> None:
    from autopipe.runtime import JobData, model_factory

    (tmp_path / "alex.py").write_text(FACTORIES)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    np.savez(tmp_path / "eight.npz", x=x, y=x[:, :1])
    source = model_factory(f"{tmp_path / 'alex.py'}:build", batch_size=2, seq_len=16, loss="mse")
    data = JobData(source, str(tmp_path / "eight.npz"), seq_len=16)
    assert data.short_of(8) is None
    assert data.short_of(32) == (
        f"warning: {tmp_path / 'eight.npz'} holds 8 samples but one step takes 32 rows (batch size x micro-batches x "
        "replicas): every step sees each of them 4.0 times (an epoch every 0.25 steps); give more data or a smaller "
        "--batch-size / --microbatches.")
    assert data.epoch(3, 32) == 12.0


@pytest.mark.parametrize("limit,why", [("20.5MiB", "stages would fit"), ("20.01MiB", "alone needs")])
def test_the_memory_limit_the_advice_names_fits_when_tried(tmp_path: Path, limit: str, why: str) -> None:
    """convert a tiny GPT-2 under a limit too small for 2 stages (the runtime's reserve given, 20 MiB,
    as the probe would measure it), also one below its largest layer alone: the refusal names a
    --memory-limit above the reserve, and convert under exactly that limit writes the job."""
    from autopipe.job.converter import convert

    tiny = tiny_gpt2_job(tmp_path, layers=2, microbatches=2, rows=2, seq=16)
    options = dict(stages=2, estimate=True, seq_len=16, batch_size=2, reserve="20MiB", progress=False)
    with pytest.raises(InfeasibleMemoryError) as info:
        convert(str(tiny), out=tmp_path / "small", memory_limit=limit, **options)
    assert why in str(info.value), str(info.value)
    found = re.search(r"--memory-limit (\S+) fits 2 stages", str(info.value))
    assert found, str(info.value)
    assert parse_size(found[1]) > 20 * 2**20
    result = convert(str(tiny), out=tmp_path / "fits", memory_limit=found[1], **options)
    assert result.plan.stages == 2 and max(result.plan.rank_memory) <= parse_size(found[1])


@pytest.mark.slow
@pytest.mark.distributed
def test_a_bad_train_py_flag_is_one_line_from_rank_0(torchrun: Launcher, tmp_path: Path) -> None:
    """A value argparse refuses on 2 ranks: one line, no usage text per rank, exit 1; a misspelled flag
    (one process) names the flag meant. (A misspelled flag on 2 ranks is test_run_launcher's --stpes:
    the same one-line path as the refused value.)"""
    tiny_gpt2_job(tmp_path, layers=2, microbatches=2, rows=2, seq=16)
    proc = torchrun(tmp_path / "train.py", "--steps", "two", nproc=2, cwd=tmp_path, check=False)
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: argument --steps: invalid int value: 'two'"), proc.stderr[-2000:]
    assert "usage:" not in proc.stdout + proc.stderr
    single = subprocess.run([sys.executable, str(tmp_path / "train.py"), "--lr-shedule", "linear"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert single.returncode == 1 and single.stderr.strip() == "error: unknown flag --lr-shedule; did you mean --lr-schedule?"


def test_refusals_name_the_flag_a_person_gave(tmp_path: Path) -> None:
    from autopipe.runtime.data.sources import check_data_path

    with pytest.raises(AutopipeError, match="--eval-data 'nowhere.bin' does not exist"):
        check_data_path(Path("nowhere.bin"), flag="--eval-data")
