"""Rank processes forked from an interpreter that has already imported torch and transformers.

Each rank a test starts spends about 5 s of CPU importing torch, transformers and torch's pipelining
before it runs a line of the job (measured on the 2-core machine: ``python -c "import torch,
transformers, torch.distributed.pipelining"`` 5.4 s), and the suite starts some hundreds of ranks.
A fork server pays that once per pytest process: it imports them, then forks one child per rank
asked for, and the child runs the script as ``python script args`` would (``runpy`` as
``__main__``, ``sys.argv``, the script's folder first on ``sys.path``, the request's PYTHONPATH
folders after it and their ``sitecustomize``, its own environment, working folder, session and
output files), so the script cannot tell the difference, except in what a fresh interpreter decides
at its start:

- **the hash seed**: every child of one server has the server's ``PYTHONHASHSEED``. Two servers
  with different seeds serve alternate ranks, so two ranks of a job never share one, as two fresh
  processes would not (code that iterated a set of strings in a rank-dependent order still fails);
- **what is read at import**: a request whose environment differs from the server's in what torch,
  the C libraries or Python read when they start (``PYTHON*``, ``TORCH*``, ``OMP*``, ``LD_*``,
  ``MALLOC_*``, ... ``_AT_START`` below), or that needs a ``sitecustomize`` where the server has
  one, is not forked: :func:`can_fork` says no and the caller starts a fresh process;
- **what is imported already**: torch, transformers and autopipe's runtime (``_PRELOAD``; autopipe
  from the package this pytest process imports), where a fresh process imports them when the script
  does; module state made at import is the server's, and the child's sys.modules has more in it;
- **the heap**: the child's heap holds the server's imports as a fresh process's does, in another
  layout. Tests that set a rank's measured memory against a prediction start fresh processes
  (``Launcher(..., fresh=True)``);
- **the collector**: the server freezes what it imported (``gc.freeze``), so a child's collections
  never walk it. Unfrozen, a child's first full collection (the runtime's, before its memory
  baseline) wrote to every inherited object and so copied the server's heap page by page: ~1 s of
  CPU per rank, measured with py-spy on a tp 2 x pp 2 job (train.py's samples 669 -> 426 over 4 ranks).

The server is single-threaded (a fork copies only the calling thread): it reads requests from its
stdin, one JSON line each, forks, answers the child's pid, and reports each child's exit status
as it reaps it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["ForkedRank", "can_fork", "spawn"]

# environment variables something reads once, when the interpreter, a C library or torch starts
_AT_START = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "LD_", "MALLOC_", "GLIBC", "CUDA", "NCCL",
             "DS_", "TRANSFORMERS", "HF_", "TOKENIZERS")
# ... except what torchrun gives each run and the runtime reads when it sets up (a new run id each launch)
_PER_RUN = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
# ... and what a library sets in the pytest process itself when a test imports it (inductor: its cache folder,
# at its default; DeepSpeed: KMP_DUPLICATE_LIB_OK, which a rank importing DeepSpeed sets again): read later,
# not at start, they would otherwise start a second and third server pair mid-session (~20 s of CPU each)
_SET_IN_SESSION = ("TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK")
_PRELOAD = ("torch", "torch.distributed", "torch.distributed.pipelining", "torch.export", "torch.utils.checkpoint",
            "transformers", "transformers.modeling_utils", "safetensors.torch",
            # what every rank's first torch.export imports (aot_autograd brings networkx: ~0.5 s of CPU)
            # and what a HuggingFace model's class pulls in (generation: ~0.1 s)
            "torch.export._trace", "torch._functorch.aot_autograd", "transformers.generation.utils")
# autopipe's own runtime, from the package this pytest process imports (a worktree's, by PYTHONPATH,
# not whatever site-packages would give the server), so a rank forked from the server runs that code
_PRELOAD_AUTOPIPE = ("autopipe.runtime.torch_engine.trainer", "autopipe.runtime.stage.build", "autopipe.graph.flattener")
_ROOT_VAR = "_AUTOPIPE_TESTS_PACKAGE_ROOT"
_DISABLED = "AUTOPIPE_TESTS_NO_FORK"  # set (to anything) to start every rank as a fresh process


def _server_main() -> None:  # runs in the server process (python -c ...)
    import importlib
    import runpy

    for name in _PRELOAD:
        importlib.import_module(name)
    root = os.environ.pop(_ROOT_VAR, None)
    if root:
        sys.path.insert(0, root)
        for name in _PRELOAD_AUTOPIPE:
            importlib.import_module(name)
        sys.path.remove(root)
    # Move everything imported so far out of the collector's reach: a child's first collection would
    # otherwise walk (and, writing each object's header, copy page by page) the whole inherited heap
    gc.collect()
    gc.freeze()
    base_path = list(sys.path)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    children: set[int] = set()
    stdin = sys.stdin.fileno()
    buffer = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if ready:
            chunk = os.read(stdin, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                req = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(req, base_path, runpy)  # never returns
                children.add(pid)
                out.write(json.dumps({"id": req["id"], "pid": pid}) + "\n")
                out.flush()
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                out.write(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}) + "\n")
                out.flush()


def _child(req: dict, base_path: list[str], runpy) -> None:  # noqa: ANN001
    """In the forked child: become ``python script args`` with the request's environment, then exit."""
    code = 1
    try:
        os.setsid()
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        for target, path in ((1, req["stdout"]), (2, req["stderr"])):
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(fd, target)
            os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False, buffering=1 if os.isatty(1) else -1)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False, buffering=1)  # noqa: SIM115
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        script = os.path.abspath(req["argv"][0])
        extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(script), *[os.path.abspath(p) for p in extra],
                       *[p for p in base_path[1:] if p not in extra]]
        sys.argv = list(req["argv"])
        if any((Path(p) / "sitecustomize.py").is_file() for p in extra):
            import sitecustomize  # noqa: F401  (as site.py would at a fresh start)
        if "numpy" in sys.modules:  # a fresh process draws numpy's global seed from the OS
            sys.modules["numpy"].random.seed()
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except KeyboardInterrupt:  # as the interpreter does: sys.excepthook, then death by SIGINT
            import signal

            sys.excepthook(*sys.exc_info())
            with contextlib.suppress(BaseException):
                sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # as the interpreter does: sys.excepthook (the script's own, if it set one), status 1
            sys.excepthook(*sys.exc_info())
            code = 1
        with contextlib.suppress(BaseException):
            threading._shutdown()  # type: ignore[attr-defined]  (the interpreter joins its threads first)
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class _Server:
    """One fork server process, started on first use, and what it reports."""

    def __init__(self, env: Mapping[str, str], hash_seed: int) -> None:
        import importlib.util

        spec = importlib.util.find_spec("autopipe")
        root = str(Path(spec.origin).parent.parent) if spec is not None and spec.origin else ""
        self.env = {**env, "PYTHONHASHSEED": str(hash_seed), _ROOT_VAR: root}
        self.proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                                      "import _forkserver; _forkserver._server_main()"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd="/",
                                     text=True, bufsize=1)  # fmt: skip
        self.cond = threading.Condition()
        self.codes: dict[int, int] = {}
        self.pids: dict[int, int] = {}
        self.next_id = 0

    def wait_ready(self) -> _Server:
        """Wait for the server's imports (both servers of a pair import at once: 2 cores)."""
        first = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not first or not json.loads(first).get("ready"):
            raise RuntimeError("the tests' fork server did not start")
        threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            msg = json.loads(line)
            with self.cond:
                if "pid" in msg:
                    self.pids[msg["id"]] = msg["pid"]
                else:
                    self.codes[msg["exited"]] = msg["code"]
                self.cond.notify_all()

    def fork(self, argv: Sequence[str], cwd: Path, env: Mapping[str, str], stdout: str, stderr: str) -> int:
        with self.cond:
            req_id = self.next_id
            self.next_id += 1
            self.proc.stdin.write(json.dumps({"id": req_id, "argv": list(argv), "cwd": str(cwd), "env": dict(env),  # type: ignore[union-attr]
                                              "stdout": stdout, "stderr": stderr}) + "\n")  # fmt: skip
            self.proc.stdin.flush()  # type: ignore[union-attr]
            if not self.cond.wait_for(lambda: req_id in self.pids, timeout=60):
                raise RuntimeError("the tests' fork server did not answer")
            return self.pids.pop(req_id)


class ForkedRank:
    """The part of ``subprocess.Popen`` tests/_ranks.py uses, for a rank the fork server started."""

    def __init__(self, server: _Server, pid: int) -> None:
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        with self.server.cond:
            self.returncode = self.server.codes.get(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.cond:
            if not self.server.cond.wait_for(lambda: self.pid in self.server.codes, timeout=timeout):
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            self.returncode = self.server.codes[self.pid]
        return self.returncode


_SERVERS: dict[tuple, list[_Server]] = {}
_MAX_KINDS = 3  # start environments served; beyond them a rank starts fresh (each pair holds ~1 GB)


def _at_start(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(_AT_START) and not k.startswith(_PER_RUN) and k not in ("PYTHONPATH", *_SET_IN_SESSION)}


def _key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """Which servers serve ``env``: those started with the same variables read at start."""
    return tuple(sorted(_at_start(env).items()))


def _own_sitecustomize(env: Mapping[str, str]) -> bool:
    """Whether ``env``'s PYTHONPATH brings a sitecustomize (a test's probe) where the interpreter, and so
    every server started from it, already imported one: the child could not import the request's."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return "sitecustomize" in sys.modules and any((Path(p) / "sitecustomize.py").is_file() for p in paths)


def can_fork(argv: Sequence[str], env: Mapping[str, str]) -> bool:
    """Whether ``argv`` (``python script ...``) may run as a child of a fork server: a Python script,
    forking not switched off, a POSIX system, no hash seed or sitecustomize of its own to start with,
    and a start environment served (or room for one more)."""
    return (hasattr(os, "fork") and _DISABLED not in os.environ and len(argv) >= 2 and argv[0] == sys.executable
            and str(argv[1]).endswith(".py") and "PYTHONHASHSEED" not in env and not _own_sitecustomize(env)
            and (_key(env) in _SERVERS or len(_SERVERS) < _MAX_KINDS))  # fmt: skip


def spawn(argv: Sequence[str], *, rank: int, cwd: Path, env: Mapping[str, str], stdout: str, stderr: str) -> ForkedRank:
    """Fork ``python argv[1:]`` for ``rank`` from the server whose start environment matches ``env``
    (started on first use; two per environment, alternating by rank: the hash seeds differ)."""
    key = _key(env)
    servers = _SERVERS.get(key)
    if servers is None:
        start_env = {**os.environ, **_at_start(env)}
        start_env.pop("PYTHONPATH", None)
        servers = _SERVERS[key] = [s.wait_ready() for s in [_Server(start_env, seed) for seed in (11, 12)]]
    server = servers[rank % 2]
    child_env = {**env, "PYTHONHASHSEED": server.env["PYTHONHASHSEED"]}
    return ForkedRank(server, server.fork([str(a) for a in argv[1:]], cwd, child_env, stdout, stderr))
