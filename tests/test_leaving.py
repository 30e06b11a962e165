"""How a rank leaves when torch wraps the cause: a checkpoint save caught by Ctrl-C or failing on a
rank (torch's CheckpointException, a BaseException whose text is every rank's traceback), and the
peer watch stopped before the process group goes away."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from autopipe.runtime.process.lifecycle import _watch, _WatchStop

ROOT = Path(__file__).resolve().parents[1]

RAISE = """
import os, signal, sys, time
from torch.distributed.checkpoint.api import CheckpointException
from autopipe.runtime.process.lifecycle import one_line_errors
one_line_errors(sys.argv[1])
if sys.argv[2] == "cut":  # Ctrl-C during a write, its KeyboardInterrupt lost inside torch's zip writer
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    except KeyboardInterrupt:
        pass
cut = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 628 vs 598")
cause = {"interrupt": KeyboardInterrupt(), "disk": OSError(28, "No space left on device"), "cut": cut}[sys.argv[2]]
raise CheckpointException("save failed", {0: (cause, None), 1: (cause, None)})
"""


@pytest.mark.parametrize(("cause", "code", "line"), [
    ("interrupt", 130, "interrupted: no checkpoint saved yet (--ckpt-every N saves every N steps)"),
    ("cut", 130, "interrupted: no checkpoint saved yet (--ckpt-every N saves every N steps)"),
    ("disk", 1, "error: a checkpoint save or load failed on rank(s) 0, 1; rank 0: OSError: [Errno 28] No space left on device"),
])
def test_a_checkpoint_exception_is_one_line(tmp_path: Path, cause: str, code: int, line: str) -> None:
    proc = subprocess.run([sys.executable, "-c", RAISE, str(tmp_path / "ckpt"), cause], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    said = [s for s in (proc.stdout + proc.stderr).splitlines() if s.strip()]
    assert proc.returncode == code, proc.stderr[-2000:]
    assert said == [line], proc.stderr[-2000:]


class _Store:
    def __init__(self) -> None:
        self.calls = 0

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        time.sleep(0.05)  # a store call in flight when the stop comes
        return False


def test_stopping_the_peer_watch_waits_for_it_to_leave_the_store() -> None:
    store, stop = _Store(), _WatchStop()
    stop.thread = threading.Thread(target=_watch, args=(store, stop, 0.01), daemon=True)
    stop.thread.start()
    while store.calls < 3:
        time.sleep(0.01)
    stop.set()
    assert not stop.thread.is_alive()  # the process group may go now: nothing of ours is inside the store
