"""`autopipe run JOB [train.py flags]`: the job on torch's elastic launcher, only rank 0 on the terminal.

Under torchrun a failure is the job's one line followed by 30-50 lines of torchrun's report, and
every launch warns about OMP_NUM_THREADS. `autopipe run` shows one line saying where each rank's
output is kept, then rank 0's output; a failure is the one `error:` line (exit 1); Ctrl-C stops
every rank and the line names the command that resumes (`autopipe run JOB ... --resume`, exit 130).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _factories import tiny_gpt2_job
from _launch import Launcher

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # each test starts 2 ranks through the launcher

AUTOPIPE = [str(Path(sys.executable).with_name("autopipe"))]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("launcher")
    tiny_gpt2_job(root, layers=2, microbatches=2, rows=2, seq=16)
    (root / "plan.json").write_text('{"boundaries": [0, 2, 5]}')  # 2 stages of the 5 layers: autopipe run starts 2 processes
    return root


def _run(job: Path, *flags: str, torchrun: Launcher, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*AUTOPIPE, "run", str(job), *flags], cwd=job, capture_output=True, text=True, timeout=timeout,
                          env=torchrun.environ({"COLUMNS": "200"}))


def test_a_run_shows_rank_0_only_and_keeps_every_rank_s_log(job: Path, torchrun: Launcher) -> None:
    done = _run(job, "--steps", "2", "--logs", str(job / "logs-ok"), torchrun=torchrun)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.splitlines()
    assert out[0] == f"autopipe run: 2 process(es) of {job / 'train.py'}; each rank's output in {job / 'logs-ok'}/"
    assert [line.split()[1] for line in out if line.startswith("step")] == ["1/2", "2/2"]
    assert "[default" not in done.stdout and "OMP_NUM_THREADS" not in done.stderr and "W" not in done.stderr[:1]
    assert done.stderr == ""
    logs = {p.parent.name: p for p in (job / "logs-ok").glob("*/attempt_0/*/stdout.log")}
    assert sorted(logs) == ["0", "1"] and "step     2/2" in logs["0"].read_text()
    assert (job / "logs-ok" / "launcher.log").is_file()


def test_a_failure_is_one_line_and_exit_1(job: Path, torchrun: Launcher) -> None:
    """A missing data file, and a flag train.py lacks: the one line each, nothing of the launcher's."""
    for flags, line in ((["--data", "missing.bin"], "error: --data 'missing.bin' does not exist."),
                        (["--stpes", "3"], "error: unknown flag --stpes; did you mean --steps?")):
        done = _run(job, *flags, torchrun=torchrun)
        assert done.returncode == 1
        assert done.stderr.splitlines() == [line], done.stderr[-3000:]
        assert "Traceback" not in done.stdout + done.stderr and "ChildFailedError" not in done.stdout + done.stderr


def test_a_rank_killed_without_a_word_is_one_line_naming_its_log(job: Path, torchrun: Launcher) -> None:
    """Rank 1 SIGKILLed after its first checkpoint (tests/faults): one error line, exit 1."""
    env = torchrun.environ({"AUTOPIPE_TEST_KILL_AT": "1:1"}, pythonpath=[Path(__file__).parent / "faults"])
    done = subprocess.run([*AUTOPIPE, "run", str(job), "--steps", "3", "--ckpt-every", "1", "--ckpt-dir",
                           str(job / "killed-ckpt")], cwd=job, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "rank 1" in lines[0], done.stderr[-3000:]


def test_ctrl_c_stops_every_rank_and_names_the_resume_command(job: Path, torchrun: Launcher) -> None:
    """SIGINT to the launcher's process group, as a terminal sends it, after step 3: rank 0's one
    line names the newest checkpoint and `autopipe run JOB <the flags> --resume`; exit 130; that
    command resumes."""
    ckpt = job / "ctrl-c"
    cmd = [*AUTOPIPE, "run", str(job), "--steps", "100000", "--ckpt-every", "1", "--ckpt-dir", str(ckpt)]
    proc = torchrun.interrupt_at(cmd, cwd=job)
    err = proc.stderr
    assert proc.returncode == 130, err[-3000:]
    said = [line for line in err.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith(f"interrupted: newest checkpoint {ckpt}/step_"), err[-3000:]
    resume = said[0].split("resume with: ")[1]
    assert resume == f"autopipe run {job} --steps 100000 --ckpt-every 1 --ckpt-dir {ckpt} --resume"
    again = _run(job, "--steps", "20", "--ckpt-every", "1", "--ckpt-dir", str(ckpt), "--resume", torchrun=torchrun)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr[-3000:]
