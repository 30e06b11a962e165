"""N ranks of a script started directly, each with the environment torchrun gives its workers.

torchrun's elastic agent is a Python process of its own that imports torch and sets up a rendezvous
before it starts any worker: on this machine a trivial 2-rank gloo job takes about twice as long
under it as with the ranks spawned here. The tests that check what a job computes do not need the
agent, only what it gives a worker; the tests of torchrun's own behaviour (its output, its signals,
elastic runs) keep it (``Launcher(..., elastic=True)`` and ``Launcher.command``).

What is kept from torchrun, because the code under test relies on it:

- the environment of one node's workers (``rank_environ``): what ``autopipe.runtime`` reads
  (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR,
  MASTER_PORT, TORCHELASTIC_RUN_ID for the shared error log) and the rest of what the agent sets,
  so a rank cannot tell the difference;
- the store outside the ranks: this process hosts the TCPStore every rank joins as a client
  (TORCHELASTIC_USE_AGENT_STORE=True, as torchrun's agent does). With rank 0 hosting it, a rank
  still joining when rank 0 had left on an error printed c10d's "Connection reset by peer"
  warning; and the port is the store's own, so no other process can take it in between;
- one stdout and one stderr shared by every rank, interleaved as torchrun's inherited streams are;
- each rank in a session of its own, and the agent's way out: when a rank fails, SIGTERM to every
  other rank (the runtime turns it into its one line), SIGKILL to whatever is left ``GRACE_S``
  later, so a rank stuck in a collective never holds the test; the result's return code is the
  first failed rank's (torchrun exits 1 for any failure: the tests only ask for non-zero, or for 1
  where the failing rank itself exits 1).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Mapping, Sequence

from _forkserver import ForkedRank, can_fork, spawn
from torch.distributed import TCPStore

__all__ = ["GRACE_S", "RankRun", "rank_environ", "run_ranks"]

GRACE_S = 30.0  # torchrun's own wait between SIGTERM and SIGKILL (LocalElasticAgent's shutdown timeout)
POLL_S = 0.05  # how often the ranks are looked at (torchrun's monitor interval is 0.1 s)


def rank_environ(base: Mapping[str, str], *, rank: int, world: int, port: int, run_id: str) -> dict[str, str]:
    """``base`` plus what torchrun's agent puts in a worker's environment on one node of ``world`` ranks."""
    return {
        **base,
        "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank), "ROLE_NAME": "default",
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }  # fmt: skip


@dataclass(frozen=True)
class RankRun:
    """What the ranks left: the first failed rank's exit status (0 when none failed), both shared
    streams, and whether the run was stopped at its time limit."""

    returncode: int
    stdout: str
    stderr: str
    timed_out: bool


def run_ranks(argv: Sequence[str], *, nproc: int, cwd: Path, env: Mapping[str, str], timeout: float,
              kill_tree: Callable[[int], None], fresh: bool = False) -> RankRun:
    """Run ``argv`` as ranks 0..nproc-1 and wait for all of them (see the module docstring);
    ``kill_tree(pid)`` SIGKILLs a rank and every process under it. A ``python script`` rank is forked
    from an interpreter that has imported torch already (tests/_forkserver.py) unless ``fresh``."""
    run_id = f"tests-{uuid.uuid4().hex[:12]}"
    # the ranks' store, on a port the OS picks, for as long as any rank may use it
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    port = store.port
    with tempfile.TemporaryDirectory(prefix="ranks-") as logs:
        out, err = (open(Path(logs) / name, "ab+") for name in ("stdout", "stderr"))  # O_APPEND: whole writes
        procs: list[subprocess.Popen | ForkedRank] = []
        forked = not fresh and can_fork(argv, env)
        try:
            for rank in range(nproc):
                rank_env = rank_environ(env, rank=rank, world=nproc, port=port, run_id=run_id)
                if forked:
                    procs.append(spawn(argv, rank=rank, cwd=cwd, env=rank_env, stdout=out.name, stderr=err.name))
                    continue
                procs.append(subprocess.Popen(list(argv), cwd=cwd, env=rank_env, stdin=subprocess.DEVNULL, stdout=out,
                                              stderr=err, start_new_session=True))  # fmt: skip
            returncode, timed_out = _supervise(procs, time.monotonic() + timeout, kill_tree)
        except BaseException:  # Ctrl-C in pytest, or a rank that could not start: none is left running
            for p in procs:
                kill_tree(p.pid)
                p.wait()
            raise
        finally:
            out.close()
            err.close()
        text = [(Path(logs) / name).read_bytes().decode(errors="replace") for name in ("stdout", "stderr")]
    return RankRun(returncode, text[0], text[1], timed_out)


def _supervise(procs: list[subprocess.Popen | ForkedRank], deadline: float,
               kill_tree: Callable[[int], None]) -> tuple[int, bool]:
    """Wait for every rank; after the first failure stop the others as torchrun does. Returns the
    first failed rank's status (the lowest rank of those found failed together) and whether the
    deadline passed."""
    failed: int | None = None
    kill_at = float("inf")
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        if failed is None:
            failed = next((c for c in codes if c not in (None, 0)), None)
            if failed is not None:
                kill_at = now + GRACE_S
                for p, c in zip(procs, codes):
                    if c is None:  # not yet reaped, so its session id is still its own: safe to signal
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p.pid, signal.SIGTERM)
        if all(c is not None for c in codes):
            return failed or 0, False
        if now > deadline:
            _kill_all(procs, kill_tree)
            return failed or 0, True
        if now > kill_at:
            _kill_all(procs, kill_tree)
            return failed or 0, False
        time.sleep(POLL_S)


def _kill_all(procs: list[subprocess.Popen | ForkedRank], kill_tree: Callable[[int], None]) -> None:
    for p in procs:
        if p.poll() is None:
            kill_tree(p.pid)
    for p in procs:
        p.wait()

