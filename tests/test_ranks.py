"""The tests' launcher starts the ranks itself (tests/_ranks.py): each sees what torchrun would give
it, a failed rank stops the others, and nothing outlives a run past its time limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import Launcher

# a rank's whole environment, in one write (print writes the line and its newline apart when
# unbuffered, and the ranks share one stdout)
ENV_OF_RANK = """
import json, os
os.write(1, (json.dumps(dict(os.environ)) + "\\n").encode())
"""
# what torchrun's agent adds that nothing here reads: its own signal list, the interpreter path the
# shell put in "_", and the error file of torch's @record decorator, which no autopipe code uses
AGENT_ONLY = {"_", "TORCHELASTIC_SIGNALS_TO_HANDLE", "TORCHELASTIC_ERROR_FILE"}


def _environments(torchrun: Launcher, tmp_path: Path, *, elastic: bool) -> dict[str, dict[str, str]]:
    (tmp_path / "env.py").write_text(ENV_OF_RANK)
    proc = torchrun(tmp_path / "env.py", nproc=2, cwd=tmp_path, elastic=elastic)
    seen = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {e["RANK"]: e for e in seen}


@pytest.mark.slow
@pytest.mark.distributed
def test_each_rank_sees_what_torchrun_gives_its_workers(torchrun: Launcher, tmp_path: Path) -> None:
    """Every variable torchrun's agent sets for a worker is set for a directly started rank too, with
    the same value where it is not a run's own (port, run id, error file)."""
    direct = _environments(torchrun, tmp_path, elastic=False)
    agent = _environments(torchrun, tmp_path, elastic=True)
    assert sorted(direct) == sorted(agent) == ["0", "1"]
    for rank, given in agent.items():
        missing = set(given) - AGENT_ONLY - set(direct[rank])
        assert not missing, f"rank {rank} lacks {sorted(missing)} (torchrun gives {given})"
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE",
                    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
            assert direct[rank][key] == given[key], (rank, key)
    assert direct["0"]["TORCHELASTIC_RUN_ID"] == direct["1"]["TORCHELASTIC_RUN_ID"]  # one run: one error log


FAILS = """
import os, sys, time
os.write(1, f"rank {os.environ['RANK']} up\\n".encode())
if os.environ["RANK"] == "1":
    while not os.path.exists("up0"):  # fail once rank 0 has said its line
        time.sleep(0.01)
    sys.exit(3)
open("up0", "w").close()
time.sleep(600)  # as a rank waiting for its failed peer in a collective
"""


def test_a_failed_rank_stops_the_others_and_its_status_is_the_run_s(torchrun: Launcher, tmp_path: Path) -> None:
    """Rank 1 exits 3 while rank 0 waits: rank 0 is stopped (SIGTERM, as torchrun's agent does) at
    once, not at the time limit; the run's status is 3 and both ranks' output is there."""
    (tmp_path / "fails.py").write_text(FAILS)
    proc = torchrun(tmp_path / "fails.py", nproc=2, cwd=tmp_path, timeout=60, check=False)
    assert proc.returncode == 3
    assert sorted(proc.stdout.split("\n")[:2]) == ["rank 0 up", "rank 1 up"], proc.stdout


HANGS = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # deaf to the launcher's stop
with open(sys.argv[1] + "/pid" + os.environ["RANK"], "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.slow  # waits out its 3 s limit
def test_a_run_past_its_time_limit_fails_the_test_and_leaves_no_rank(torchrun: Launcher, tmp_path: Path) -> None:
    """Ranks that never finish (and ignore SIGTERM) are killed at the time limit, and the test fails saying so."""
    (tmp_path / "hangs.py").write_text(HANGS)
    with pytest.raises(pytest.fail.Exception, match="ran past 3 s and was killed with every rank"):
        torchrun(tmp_path / "hangs.py", tmp_path, nproc=2, cwd=tmp_path, timeout=3)
    for rank in (0, 1):  # killed and reaped: gone from /proc (Linux, as the launcher's kill is)
        pid = int((tmp_path / f"pid{rank}").read_text())
        assert not Path(f"/proc/{pid}").exists(), f"rank {rank} (pid {pid}) still runs"

