"""The command that launched this run, rebuilt for the line that says how to resume it.

Under ``autopipe run JOB`` it is that command (the launcher says so in ``AUTOPIPE_RUN_COMMAND``).
Under torchrun the best source is torchrun's own command line: a worker's parent process is
torchrun's agent, so ``/proc/<parent>/cmdline`` holds every option the user gave it, rendezvous
included (``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29500 --rdzv-id 42``). Where it
cannot be read (not Linux, another launcher in between) the options are rebuilt from what torchrun
puts in each worker's environment: the node and process counts, the master's address and port.

On several nodes the line is the one to run on each of them, its node rank left as ``$NODE_RANK``
(rank 0, which prints the line, sits on node 0; the others' differ only there).

Example (a plain ``python train.py`` run):
    >>> launch_command(("--resume",)).startswith("python ")
    True
"""

from __future__ import annotations

import os
import shlex
import sys

__all__ = ["RUN_COMMAND", "launch_command", "launch_nodes", "run_local_workers"]

NODE_RANK = "$NODE_RANK"  # left for the shell of each node to fill in
RUN_COMMAND = "AUTOPIPE_RUN_COMMAND"  # set by `autopipe run` for its workers: its own command, before the flags
_NODE_RANK_FLAGS = ("--node-rank", "--node_rank")


def launch_nodes() -> int:
    """How many nodes (torchrun agents) this run spans: 1 without torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "GROUP_WORLD_SIZE" in os.environ:
        return int(os.environ["GROUP_WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return max(1, world // max(1, local))


def launch_command(extra: tuple[str, ...] = ()) -> str:
    """The command line that started this run (torchrun's, with all its options, under torchrun),
    plus ``extra``; on several nodes the one for every node, ``--node-rank $NODE_RANK``."""
    argv = [a for a in sys.argv if a not in extra]
    if os.environ.get(RUN_COMMAND):  # started by `autopipe run JOB`: the same, the script's flags after it
        return shlex.join([*shlex.split(os.environ[RUN_COMMAND]), *argv[1:], *extra])
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not ("TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_WORLD_SIZE" in os.environ and world > 1)):
        return shlex.join(["python", *argv, *extra])
    options = _torchrun_options(_parent_argv(), argv[0] if argv else "")
    if options is None:
        options = _options_from_environment(world)
    if launch_nodes() > 1:
        options = _node_rank_left_open(options)
    return " ".join(t if t == NODE_RANK else shlex.quote(t) for t in ["torchrun", *options, *argv, *extra])


def _parent_argv() -> list[str] | None:
    """The parent process's command line (torchrun's agent under torchrun), or None if unreadable."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a] or None


def _torchrun_options(parent: list[str] | None, script: str) -> list[str] | None:
    """The options between torchrun (``torchrun`` or ``python -m torch.distributed.run``) and the
    script in ``parent``; None when ``parent`` is not a torchrun command that ran ``script``."""
    if not parent or not script:
        return None
    start = None
    for i, token in enumerate(parent):
        if os.path.basename(token) == "torchrun" or (token == "torch.distributed.run" and i > 0 and parent[i - 1] == "-m"):
            start = i + 1
            break
    if start is None or script not in parent[start:]:
        return None
    return parent[start:parent.index(script, start)]


def _options_from_environment(world: int) -> list[str]:
    """torchrun's options as its workers' environment describes them (static rendezvous)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", str(world))
    nodes = launch_nodes()
    if nodes == 1:
        return [f"--nproc-per-node={local}"]
    return ["--nnodes", str(nodes), "--nproc-per-node", local, "--node-rank", NODE_RANK,
            "--master-addr", os.environ.get("MASTER_ADDR", "127.0.0.1"), "--master-port", os.environ.get("MASTER_PORT", "29500")]


def _node_rank_left_open(options: list[str]) -> list[str]:
    """``options`` with the node rank's value (this node's, 0) replaced by ``$NODE_RANK``."""
    out: list[str] = []
    skip = False
    for token in options:
        if skip:
            out.append(NODE_RANK)
            skip = False
        elif token in _NODE_RANK_FLAGS:
            out.append(token)
            skip = True
        elif token.startswith(tuple(f"{flag}=" for flag in _NODE_RANK_FLAGS)):
            out.append(f"{token.split('=', 1)[0]}")
            out.append(NODE_RANK)
        else:
            out.append(token)
    return out


def run_local_workers(module: str, ranks: int, args: list[str], *, timeout: float, failure: str) -> None:
    """Run ``python -m module --worker ARGS`` on ``ranks`` local processes under torchrun, one thread
    each and transformers quiet (autopipe's own probes: the reserve's and the doctor's); a failure is
    ``AutopipeError(f"{failure}: <the last line it printed>")``."""
    import subprocess

    from ...errors import AutopipeError

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", module, "--worker", *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise AutopipeError(f"{failure}: {tail}")
