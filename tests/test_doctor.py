"""`autopipe doctor`: the first command on a new machine, run here on the CPU as CI can."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopipe.cli import app


@pytest.mark.slow
@pytest.mark.distributed
def test_the_doctor_profiles_plans_trains_and_writes_its_table(tmp_path: Path) -> None:
    """On this CPU: the devices, then a 2-rank run of the plan whose step time and per-rank peak
    memory (allocated and reserved) stand beside the plan's, on the terminal, in the file, as JSON."""
    out = tmp_path / "doctor.md"
    done = CliRunner().invoke(app, ["doctor", "--device", "cpu", "--steps", "4", "--out", str(out), "--json"])
    assert done.exit_code == 0, done.output
    found = json.loads(done.output[done.output.index("{"):])
    assert found["ranks"] == 2 and found["devices"][0]["type"] == "cpu"
    assert found["predicted_step"] > 0 and found["measured_step"] > 0 and math.isfinite(found["step_ratio"])
    for rank in found["memory"]:
        assert rank["allocated"] > 0 and rank["reserved"] >= rank["allocated"] and rank["outside_known"]
    # the plan carries this machine's runtime reserve: each rank within a third of its prediction
    # (tests/test_memory_measured.py holds the tighter ±20 % for a pipeline of its own)
    assert all(0.67 < r < 1.5 for r in found["memory_ratios"]), found["memory_ratios"]
    table = out.read_text()
    assert "| step time |" in table and "| rank 1 peak memory (allocated" in table
    assert "no GPU here" in table  # says what it could not check


def test_the_doctor_keeps_an_existing_file_and_refuses_bad_options(tmp_path: Path) -> None:
    """Nothing the user had is overwritten without --force; a bad option is one line, before any run."""
    out = tmp_path / "doctor.md"
    out.write_text("mine")
    runner = CliRunner()
    done = runner.invoke(app, ["doctor", "--out", str(out)])
    assert done.exit_code == 1 and "already exists" in done.output and out.read_text() == "mine"
    for args, message in ((["--ranks", "3"], "--ranks 3"), (["--device", "tpu"], "--device 'tpu'"),
                          (["--steps", "1"], "--steps 1")):
        done = runner.invoke(app, ["doctor", "--out", str(tmp_path / "new.md"), "--device", "cpu", *args])
        assert done.exit_code == 1 and message in done.output, done.output
        assert len(done.output.strip().splitlines()) == 1
