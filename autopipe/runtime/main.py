"""How train.py starts, stops and fails: one line from rank 0, never a traceback per rank.

- ``one_line_errors(ckpt_dir)``: an :class:`AutopipeError` (or a file error) anywhere in train.py is
  printed once, by rank 0, as ``error: ...`` (what was wrong and what to do), and every rank exits
  with status 1; an error only another rank met reaches rank 0 through the process group's store. Ctrl-C (or the SIGTERM torchrun sends its workers then) ends each rank quietly;
  rank 0 prints the newest checkpoint and the command that resumes from it (status 130). ``AUTOPIPE_DEBUG=1`` shows the tracebacks instead. Any
  other exception (a bug, ours or torch's, or the model failing in training) is one line too, naming
  the stage, the layer and the operation that raised (``autopipe.runtime.failures``), with the path
  of a file holding every rank's full traceback.
- ``check_launch(plan, env)``: the process count fits the plan, or one line saying how to launch.
- ``resume(trainer, ckpt_dir, ...)``: ``--resume`` continues from the newest checkpoint; with none
  there it is an error (``--resume auto`` starts afresh instead); a checkpoint made with another
  ``--steps`` or other data is said so.

Under torchrun, torchrun adds its own summary of the failed processes after the line.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any, Callable

from ..errors import AutopipeError

__all__ = ["ResumeError", "check_launch", "launch_command", "one_line_errors", "resume"]


class ResumeError(AutopipeError):
    """--resume found nothing to resume, or a checkpoint that does not fit this run."""


# what gloo and NCCL say when a peer process has exited
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited", "NCCL communicator was aborted")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def launch_command(extra: tuple[str, ...] = ()) -> str:
    """The command line that started this process (torchrun's when under torchrun), plus ``extra``."""
    argv = [a for a in sys.argv if a not in extra]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_WORLD_SIZE" in os.environ and world > 1):
        head = ["torchrun", f"--nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', world)}"]
    else:
        head = ["python"]
    return shlex.join([*head, *argv, *extra])


def one_line_errors(ckpt_dir: str | os.PathLike[str] | None = None, *, latest: Callable[[Any], Any] | None = None) -> None:
    """Make uncaught autopipe errors one line from rank 0 and Ctrl-C a clean stop (see module docstring)."""
    if os.environ.get("AUTOPIPE_DEBUG"):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            # torchrun stops the others with SIGTERM when a rank fails: then say why, not "interrupted"
            word = _find_word() if _rank() == 0 else None
            if word is not None:
                _say(f"error: {word}")
                os._exit(1)
            if _rank() == 0:
                from .checkpoint import latest_checkpoint

                last = latest_checkpoint(ckpt_dir) if ckpt_dir is not None else None
                where = f"newest checkpoint {last}; resume with: {launch_command(('--resume',))}" if last else \
                    "no checkpoint saved yet (--ckpt-every N saves every N steps)"
                _say(f"interrupted: {where}")
            os._exit(130)
        if issubclass(kind, (AutopipeError, OSError)):
            message = str(value)
            if isinstance(value, OSError) and value.strerror:
                message = f"cannot access {value.filename}: {value.strerror}" if value.filename else value.strerror
            message = " ".join(message.split())
            if _rank() == 0:
                _say(f"error: {message}")
            else:  # usually rank 0 fails the same way; if not, it finds this rank's line in the store
                _leave_word(message)
            # leave at once: a rank waiting in a collective would otherwise hold the others until it times out
            os._exit(1)
        if any(s in str(value) for s in _PEER_GONE):
            # another rank failed and left: rank 0 says why (from that rank's word), the others only lost a peer
            if _rank() == 0:
                word = _find_word()
                if word is not None:
                    _say(f"error: {word}")
                    os._exit(1)
            else:
                os._exit(1)
        if issubclass(kind, Exception):
            from .failures import describe, write_traceback

            path = write_traceback(kind, value, tb)
            where = f"every rank's traceback: {path}" if path is not None else "its traceback"
            message = f"{describe(value)} ({where}; AUTOPIPE_DEBUG=1 prints them here instead)"
            if _rank() == 0:
                _say(f"error: {message}")
            else:
                _leave_word(message)
            os._exit(1)
        previous(kind, value, tb)

    sys.excepthook = hook
    # torchrun answers Ctrl-C by sending its workers SIGTERM, which would end them without a word
    # (and may come first): a stop either way, the same clean one
    import signal

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def _store() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # no store (a one-rank world made without one): nothing to share
        return None


def _leave_word(message: str) -> None:
    """Put a failing rank's line where rank 0 can read it (the process group's key-value store)."""
    store = _store()
    if store is not None:
        try:
            store.set(f"autopipe/error/{_rank()}", message)
        except Exception:  # the store's host may be gone too: nothing more to do
            pass


def _find_word() -> str | None:
    """The line a failed rank left in the store, if one did."""
    store = _store()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    for rank in range(1, world):
        key = f"autopipe/error/{rank}"
        try:
            if store is not None and store.check([key]):
                return f"rank {rank}: {store.get(key).decode()}"
        except Exception:
            return None
    return None


def _say(line: str) -> None:
    """One line on the process's real stderr: torch.distributed's own excepthook captures
    ``sys.stderr`` while it calls ours (to prefix each line with the rank), and we exit before it
    would print the capture."""
    sys.stdout.flush()
    os.write(2, (line + "\n").encode())


def check_launch(plan: Any, pp_size: int, dp_size: int, *, plan_path: str = "plan.json") -> None:
    """Refuse a process count that does not fit the plan, saying the count that does.

    One process may run any plan (every stage in turn, for debugging).
    """
    if pp_size == 1:
        return
    stages = getattr(plan, "stages", None)
    if stages is None:  # a hand-written {"boundaries": [...]} plan or a chunk count
        chunks = (len(plan.boundaries) - 1) if hasattr(plan, "boundaries") else int(plan)
        if chunks % pp_size == 0:
            return
        fits = [s for s in range(1, chunks + 1) if chunks % s == 0 and s > 1]
        raise AutopipeError(
            f"{plan_path} has {chunks} chunks, which {pp_size} pipeline ranks cannot share evenly: launch with "
            f"--nproc-per-node {' or '.join(str(s * dp_size) for s in fits)}{_dp(dp_size)}."
        )
    if stages != pp_size:
        raise AutopipeError(
            f"{plan_path} has {stages} stages but {pp_size * dp_size} processes were launched "
            f"({pp_size} per replica{_dp(dp_size)}): launch with --nproc-per-node {stages * dp_size}{_dp(dp_size)}."
        )


def _dp(dp: int) -> str:
    return f" with --dp {dp}" if dp > 1 else ""


def resume(trainer: Any, ckpt_dir: str | os.PathLike[str], *, mode: str, steps: int, data: Any = None,
           say: Callable[[str], None] = print) -> Path | None:
    """Load the newest checkpoint under ``ckpt_dir`` into ``trainer`` (``mode`` "must" or "auto").

    Returns the checkpoint, or None when ``mode`` is "auto" and there is none.
    """
    from .checkpoint import latest_checkpoint, load_checkpoint, read_meta

    last = latest_checkpoint(ckpt_dir)
    if last is None:
        if mode == "auto":
            say(f"no checkpoint in {ckpt_dir}: starting at step 0 (--resume auto)")
            return None
        raise ResumeError(
            f"--resume: no checkpoint in {ckpt_dir}; check --ckpt-dir, or use --resume auto to start afresh when there is none."
        )
    load_checkpoint(trainer, last)
    meta = read_meta(last)
    say(f"resumed from {last} at step {trainer.step_count}")
    saved_steps = int(meta.get("config", {}).get("steps", steps))
    if saved_steps != steps:
        say(f"note: the checkpoint was trained for --steps {saved_steps}; the learning rate now decays over "
            f"{steps} steps from step {trainer.step_count}")
    if data is not None and meta.get("data") and meta["data"].get("source") != data.state().get("source"):
        say(f"note: the checkpoint was trained on {meta['data']['source']}; this run reads {data.state()['source']}")
    if trainer.step_count >= steps:
        raise ResumeError(f"{last} is at step {trainer.step_count}, already at --steps {steps}: pass a larger --steps to train on.")
    return last
