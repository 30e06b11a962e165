"""The one launcher the tests start real processes with: a script on N processes (its ranks spawned
directly with torchrun's environment, or under torchrun itself where a test is about torchrun; plain
python for one), its output captured and shown when it fails. conftest.py hands it out as the
``torchrun`` fixture."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence, Union

import pytest
from _ranks import run_ranks

__all__ = ["Launcher", "free_port"]

Arg = Union[str, "os.PathLike[str]", int, float]
TAIL = 3000  # characters of each stream a failure shows


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it), for a process group a test sets up itself."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc; elsewhere none are found and only ``pid`` is killed)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # after "pid (name)": state, ppid
            children.setdefault(parent, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        out += below
        todo += below
    return out


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it: torchrun starts each rank in a session of its own,
    so killing its process group would leave the ranks running (and holding the output pipes open)."""
    for p in [*_descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _tail(text: str | bytes | None) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-TAIL:]


class Launcher:
    """``launcher(script, *args, nproc=2, cwd=...)`` runs ``script`` on ``nproc`` processes and returns
    the CompletedProcess (text stdout and stderr, every rank's interleaved).

    2 or more processes are ranks this process starts itself, each with the environment torchrun
    would give it, joining a store this process hosts as torchrun's agent does (tests/_ranks.py:
    a trivial 2-rank job takes 1.4 s against torchrun's 3.0 s); a failed rank stops the others as torchrun does.
    ``elastic=True`` runs them under ``torchrun --standalone`` instead, for a test of torchrun's own
    behaviour (its report, its signals). One process runs as ``python script`` with a free
    MASTER_PORT in its environment (for a script that sets up a group itself). Every process gets
    ``OMP_NUM_THREADS=1``: the machine is shared. The ranks are forked from an interpreter that has
    imported torch already (tests/_forkserver.py: 0.2 s for a trivial 2-rank job against 2 s), as the
    same ``python script`` in every other respect; ``fresh=True`` starts them as new processes (a
    test that sets a rank's measured memory against a prediction). ``check`` fails the test on a non-zero exit with
    the command and the tail of both streams; a run past ``timeout`` is killed with every process
    it started (no rank is left behind) and fails the same way.
    """

    def __init__(self, timeout: float = 300) -> None:
        self.timeout = timeout

    def command(self, script: Arg, *args: Arg, nproc: int = 2) -> list[str]:
        """The command line that runs ``script`` on ``nproc`` processes under torchrun (plain python
        for one), for a test that starts it itself (Ctrl-C, say)."""
        head = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"] \
            if nproc > 1 else [sys.executable]
        return [*head, str(script), *map(str, args)]

    def environ(self, env: Mapping[str, str] | None = None, *, pythonpath: Sequence[Arg] = ()) -> dict[str, str]:
        """This process's environment, one thread per process, ``env`` on top, ``pythonpath`` folders
        put first on PYTHONPATH (a test's sitecustomize probes, say)."""
        out = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        if pythonpath:
            out["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), os.environ.get("PYTHONPATH", "")])
        return out

    def __call__(self, script: Arg, *args: Arg, nproc: int = 2, cwd: Arg, env: Mapping[str, str] | None = None,
                 pythonpath: Sequence[Arg] = (), timeout: float | None = None, check: bool = True,
                 elastic: bool = False, fresh: bool = False) -> subprocess.CompletedProcess:
        full_env = self.environ(env, pythonpath=pythonpath)
        limit = timeout or self.timeout
        if nproc > 1 and not elastic:
            cmd = [sys.executable, str(script), *map(str, args)]
            ran = run_ranks(cmd, nproc=nproc, cwd=Path(cwd), env=full_env, timeout=limit, kill_tree=_kill_tree,
                            fresh=fresh)
            shown = f"{' '.join(cmd)}  (on {nproc} ranks)"
            out, err, timed_out, code = ran.stdout, ran.stderr, ran.timed_out, ran.returncode
        else:
            cmd = self.command(script, *args, nproc=nproc)
            if nproc == 1:
                full_env.setdefault("MASTER_PORT", str(free_port()))
            shown = " ".join(cmd)
            out, err, timed_out, code = _run_one(cmd, Path(cwd), full_env, limit)
        if timed_out:
            pytest.fail(f"{shown}\nran past {limit:g} s and was killed with every rank\n"
                        f"---- stdout\n{_tail(out)}\n---- stderr\n{_tail(err)}", pytrace=False)
        done = subprocess.CompletedProcess(cmd, code, out, err)
        if check and code != 0:
            pytest.fail(f"{shown}\nexited {code}\n---- stdout\n{_tail(out)}\n---- stderr\n{_tail(err)}",
                        pytrace=False)
        return done

    def interrupt_at(self, cmd: Sequence[Arg], *, cwd: Arg, marker: str = "step     3",
                     timeout: float = 120) -> subprocess.CompletedProcess:
        """Run ``cmd`` and press Ctrl-C as a terminal does once a stdout line starts with ``marker``:
        SIGINT to its own process group (the launcher and every rank)."""
        proc = subprocess.Popen([str(c) for c in cmd], cwd=Path(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=self.environ({"COLUMNS": "200"}), start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        seen = []
        for line in proc.stdout:  # type: ignore[union-attr]
            seen.append(line)
            if line.startswith(marker):
                break
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(seen) + out, err)


def _run_one(cmd: list[str], cwd: Path, env: dict[str, str], limit: float) -> tuple[str, str, bool, int]:
    """Run one process (plain python, or torchrun's agent) to its end or ``limit``: stdout, stderr,
    whether it timed out (then it was killed with every process under it), its exit status."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=limit)
        return out, err, False, proc.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)
        out, err = proc.communicate()
        return out, err, True, proc.returncode
    except BaseException:  # Ctrl-C in pytest: no rank is left running
        _kill_tree(proc.pid)
        proc.communicate()
        raise
