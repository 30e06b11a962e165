"""How train.py starts, stops and fails: one line from rank 0, never a traceback per rank.

- ``one_line_errors(ckpt_dir)``: an :class:`AutopipeError` (or a file error) anywhere in train.py is
  printed once, by rank 0, as ``error: ...`` (what was wrong and what to do), and every rank exits
  with status 1; an error only another rank met reaches rank 0 through the process group's store. Ctrl-C (or the SIGTERM torchrun sends its workers then) ends each rank quietly;
  rank 0 prints the newest checkpoint and the command that resumes from it (status 130). ``AUTOPIPE_DEBUG=1`` shows the tracebacks instead. Any
  other exception (a bug, ours or torch's, or the model failing in training) is one line too, naming
  the stage, the layer and the operation that raised (``autopipe.runtime.process.failures``), with the path
  of a file holding every rank's full traceback.
- ``watch_peers()`` (``init_dist`` starts it): a rank that fails marks the store before it leaves;
  every other rank then leaves too (rank 0 saying why), even one blocked inside a collective that
  will never finish: NCCL may not notice a peer that left until its timeout, 10 minutes later.
- ``check_launch(plan, env)``: the process count fits the plan, or one line saying how to launch.
- ``resume(trainer, ckpt_dir, ...)``: ``--resume`` continues from the newest checkpoint; with none
  there it is an error (``--resume auto`` starts afresh instead); a checkpoint made with another
  ``--steps`` or other data is said so.

Under torchrun, torchrun adds its own summary of the failed processes after the line.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

from ...errors import AutopipeError
from ...planner.stage_plan import StagePlan
from .launch import launch_command, launch_nodes

__all__ = ["check_launch", "launch_command", "one_line_errors", "watch_peers"]


# what gloo and NCCL say when a peer process has exited, or stopped answering until a timeout
_TIMED_OUT = ("Watchdog caught collective operation timeout", "timed out in blocking wait", "Timed out waiting",
              "Socket Timeout")
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "remote process exited", "NCCL communicator was aborted",
              *_TIMED_OUT)
_FAILED = "autopipe/failed"  # store key: the rank that failed, set after its word
# store key: a rank stopped on Ctrl-C. The terminal's SIGINT reaches every rank, but a rank blocked in
# a receive runs its handler only once the receive returns, and it may return first with "connection
# closed" from a peer that stopped already: that rank reads this and stops as interrupted, not failed.
_INTERRUPTED = "autopipe/interrupted"
_LEAVING = threading.Lock()  # one way out per process: the excepthook's or the peer watch's
# set when Ctrl-C (SIGINT) or torchrun's stop (SIGTERM) reached this process: a checkpoint write it
# cut short can fail in torch's C++ zip writer ("unexpected pos ...") with the KeyboardInterrupt lost
_SIGNALLED = threading.Event()
_SAID = "autopipe/said"  # store key: rank 0 has said the run's line (a failing rank waits for it, _wait_for_rank_0)
# A bad flag or a missing file fails every rank the same way, but not at the same moment: the rank
# that gets there first would have its line said for it ("rank 1: ...") before rank 0 says its own.
# Rank 0's peer watch gives its own main thread this long to fail too; the failing rank stays alive
# a little longer still, since its exit makes torchrun stop rank 0 before rank 0 could say anything.
_OWN_LINE_GRACE = 2.0
_WATCH_INTERVAL = 1.0  # how often the peer watch reads the store (watch_peers' default)


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


_INSTALLED: dict[str, Any] = {}  # the hook, once per process, and the checkpoint folder its Ctrl-C names


def one_line_errors(ckpt_dir: str | os.PathLike[str] | None = None, *, latest: Callable[[Any], Any] | None = None) -> None:
    """Make uncaught autopipe errors one line from rank 0 and Ctrl-C a clean stop (see module docstring).

    Called again (``parse_flags`` installs it before the flags are read), it only points the Ctrl-C
    hint at ``ckpt_dir``."""
    if os.environ.get("AUTOPIPE_DEBUG"):
        return
    if "hook" in _INSTALLED:
        if ckpt_dir is not None:
            _INSTALLED["ckpt_dir"] = ckpt_dir
        return
    _INSTALLED["ckpt_dir"] = ckpt_dir
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        # leaving already: torchrun's stop must not cut the line, nor wake a rank whose peer watch is
        # on its way out (waiting for rank 0's line) into a traceback from inside this hook
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _leave_alone()
        if issubclass(kind, KeyboardInterrupt) or _interrupted(value):
            # torchrun stops the others with SIGTERM when a rank fails: then say why, not "interrupted"
            word = _find_word() if _rank() == 0 else None
            if word is not None:
                _say(f"error: {word}")
                os._exit(1)
            if _rank() == 0:
                _say_interrupted()
            else:
                _set_key(_INTERRUPTED)
            os._exit(130)
        wrapped = _checkpoint_error(value)
        if wrapped is not None:
            kind, value = AutopipeError, wrapped
        if issubclass(kind, (AutopipeError, OSError)):
            message = str(value)
            if isinstance(value, OSError) and value.strerror:
                message = f"cannot access {value.filename}: {value.strerror}" if value.filename else value.strerror
            message = " ".join(message.split())
            if _rank() == 0:
                _say(f"error: {message}")
                _announce_failure()
            else:  # usually rank 0 fails the same way; if not, it finds this rank's line in the store
                _leave_word(message)
                _wait_for_rank_0()
                if _store() is None:  # before the process group: no store, and torchrun stops rank 0
                    time.sleep(2)  # when this rank exits, before it says its (same) line: let it say it
            # leave at once: a rank waiting in a collective would otherwise hold the others until it times out
            os._exit(1)
        if any(s in str(value) for s in _PEER_GONE):
            # another rank failed and left: rank 0 says why (from that rank's word), the others only lost a peer
            if _rank() == 0:
                word = _find_word()
                if word is not None:
                    _say(f"error: {word}")
                    os._exit(1)
                if _key_set(_INTERRUPTED):  # a peer stopped on the Ctrl-C this rank has not seen yet
                    _say_interrupted()
                    os._exit(130)
                if any(s in str(value) for s in _TIMED_OUT):
                    first = str(value).strip().splitlines()[0][:200]
                    _say(f"error: a collective timed out ({first}); another rank stopped answering without a word: "
                         "it hung or was killed (its own output, or the launcher's, says which)")
                    os._exit(1)
            else:
                _wait_for_rank_0()
                os._exit(1)
        if issubclass(kind, Exception):
            from .failures import describe, write_traceback

            path = write_traceback(kind, value, tb)
            where = f"every rank's traceback: {path}" if path is not None else "its traceback"
            message = f"{describe(value)} ({where}; AUTOPIPE_DEBUG=1 prints them here instead)"
            if _rank() == 0:
                _say(f"error: {message}")
                _announce_failure()
            else:
                _leave_word(message)
                _wait_for_rank_0()
            os._exit(1)
        previous(kind, value, tb)
        _announce_failure()  # not an Exception (SystemExit and kin): the other ranks leave too

    sys.excepthook = hook
    _INSTALLED["hook"] = hook
    # torchrun answers Ctrl-C by sending its workers SIGTERM, which would end them without a word
    # (and may come first): a stop either way, the same clean one
    def stop(signum: int, frame: Any) -> None:
        _SIGNALLED.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the launcher ignores it
        signal.signal(signal.SIGINT, stop)  # as Python's own (KeyboardInterrupt), remembered


def _interrupted(value: BaseException) -> bool:
    """Whether ``value`` is a Ctrl-C that torch wrapped: a checkpoint save caught mid-write gathers each
    rank's exception, KeyboardInterrupt included, into one CheckpointException (its text the tracebacks)."""
    failures = _checkpoint_failures(value)
    if any(isinstance(exc, KeyboardInterrupt) for exc in failures.values()):
        return True
    if failures and _SIGNALLED.is_set():  # a write the signal cut short, failing on its own terms
        return True
    seen = value.__cause__ or value.__context__
    while seen is not None:
        if isinstance(seen, KeyboardInterrupt):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _checkpoint_failures(value: BaseException) -> dict[int, BaseException]:
    """Each rank's exception inside torch's CheckpointException (rank -> (exception, trace)); {} otherwise."""
    failures = getattr(value, "failures", None) if type(value).__name__ == "CheckpointException" else None
    if not isinstance(failures, dict):
        return {}
    return {int(r): f[0] if isinstance(f, tuple) else f for r, f in failures.items()}


def _checkpoint_error(value: BaseException) -> AutopipeError | None:
    """A failed checkpoint save or load as one line: torch's CheckpointException is a BaseException
    whose text is every rank's traceback."""
    failures = _checkpoint_failures(value)
    if not failures:
        return None
    rank, exc = min(failures.items())
    first = " ".join(traceback.format_exception_only(type(exc), exc)[-1].split())
    return AutopipeError(f"a checkpoint save or load failed on rank(s) {', '.join(map(str, sorted(failures)))}; "
                         f"rank {rank}: {first}")


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
    _announce_failure()


def _say_interrupted() -> None:
    """Rank 0's line on Ctrl-C: the newest checkpoint and the command that resumes from it."""
    from ..checkpoints.folders import latest_checkpoint

    folder = _INSTALLED.get("ckpt_dir")
    last = latest_checkpoint(folder) if folder is not None else None
    nodes = f", on each of the {launch_nodes()} nodes" if launch_nodes() > 1 else ""
    where = f"newest checkpoint {last}; resume with{nodes}: {launch_command(('--resume',))}" if last else \
        "no checkpoint saved yet (--ckpt-every N saves every N steps)"
    _say(f"interrupted: {where}")


def _set_key(key: str) -> None:
    store = _store()
    if store is not None:
        try:
            store.set(key, str(_rank()))
        except Exception:  # the store's host may be gone too: nothing more to do
            pass


def _key_set(key: str) -> bool:
    store = _store()
    try:
        return store is not None and bool(store.check([key]))
    except Exception:
        return False


def _announce_failure() -> None:
    """Tell the other ranks' peer watches that this rank is leaving on an error."""
    _set_key(_FAILED)


def _leave_alone() -> None:
    """Go on only if this process is not already leaving: the peer watch may be, and it exits."""
    if not _LEAVING.acquire(blocking=False):
        while True:  # the watch exits the process; a Ctrl-C meanwhile must not print a traceback
            try:
                threading.Event().wait()
            except KeyboardInterrupt:
                continue


def watch_peers(interval: float = _WATCH_INTERVAL) -> threading.Event | None:
    """Leave as soon as another rank has failed (collective-free: a daemon thread reads the store).

    A rank that fails marks the store (``one_line_errors``) and exits. Its peers may be waiting for
    it inside a collective: gloo sees the closed connection at once, but NCCL may wait out its
    timeout, and a Python signal handler (torchrun's SIGTERM) cannot run while the main thread is
    inside one. This thread looks every ``interval`` seconds; when the mark appears, rank 0 prints
    the failed rank's line (one line, as the excepthook would) and every rank exits with status 1.
    Returns the event that stops the watch (set it before tearing the process group down), or None
    in a one-rank world.
    """
    store = _store()
    if store is None or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return None
    stop = _WatchStop()
    stop.thread = threading.Thread(target=_watch, args=(store, stop, interval), name="autopipe-peer-watch", daemon=True)
    stop.thread.start()
    return stop


class _WatchStop(threading.Event):
    """The peer watch's stop event. ``set`` also waits for the watch to leave the store: a thread still
    inside a store call while the process group is torn down aborted a rank at exit ("terminate called
    without an active exception", SIGABRT, after a run had finished)."""

    thread: threading.Thread | None = None

    def set(self) -> None:
        super().set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=10)


def _watch(store: Any, stop: threading.Event, interval: float) -> None:
    while not stop.wait(interval):
        try:
            if not store.check([_FAILED]):
                continue
            failed = store.get(_FAILED).decode()
        except Exception:  # the store is gone: the run has ended (a lost host the collectives report)
            return
        if failed == str(_rank()) or stop.is_set():
            return  # this rank is the one failing, or the run is over
        if _rank() == 0:  # rank 0 may be about to fail the same way: then its own line, without "rank N:"
            deadline = time.monotonic() + _OWN_LINE_GRACE
            while time.monotonic() < deadline and not _LEAVING.locked():
                time.sleep(0.05)
        if not _LEAVING.acquire(blocking=False):
            return  # on its way out already
        if _rank() == 0:
            word = _find_word()
            _say(f"error: {word}" if word else f"error: rank {failed} failed (its output above says why)")
        else:  # a third rank leaving now would make torchrun stop rank 0 before its own line, as the failed one would
            _wait_for_rank_0()
        os._exit(1)


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
    would print the capture. On rank 0 it also marks the store: a failing rank waits for that."""
    sys.stdout.flush()
    os.write(2, (line + "\n").encode())
    if _rank() == 0:
        _set_key(_SAID)


def _wait_for_rank_0(interval: float = 0.05) -> None:
    """Keep a failing rank alive until rank 0 has said its line (at most the peer watch's interval and
    grace, and a second more): its exit would make torchrun stop rank 0 before that."""
    store = _store()
    deadline = time.monotonic() + _WATCH_INTERVAL + _OWN_LINE_GRACE + 1.0
    while store is not None and time.monotonic() < deadline:
        try:
            if store.check([_SAID]):
                return
        except Exception:  # the store is gone with its host: nobody is left to wait for
            return
        time.sleep(interval)


def check_launch(plan: StagePlan | int, pp_size: int, dp_size: int, *, plan_path: str = "plan.json",
                 tp: int = 1) -> None:
    """Refuse a process count that does not fit the plan (a ``StagePlan``, or a chunk count to cut
    evenly), saying the count that does (stages x dp x tp).

    One process may run any plan (every stage in turn, for debugging).
    """
    if pp_size == 1:
        return
    per_stage = dp_size * tp  # processes per pipeline stage
    if isinstance(plan, int) or not plan.stages:  # a chunk count, or a hand-written cut of any stage count
        chunks = plan if isinstance(plan, int) else plan.num_chunks
        if chunks % pp_size == 0:
            return
        fits = [s for s in range(1, chunks + 1) if chunks % s == 0 and s > 1]
        raise AutopipeError(
            f"{plan_path} has {chunks} chunks, which {pp_size} pipeline ranks cannot share evenly: launch with "
            f"--nproc-per-node {' or '.join(str(s * per_stage) for s in fits)}{_dp(dp_size)}{_tp(tp)}."
        )
    if plan.stages != pp_size:
        world, per = plan.stages * per_stage, plan.gpus_per_node
        how = f"--nnodes {world // per} --nproc-per-node {per}" if per and world > per and world % per == 0 \
            else f"--nproc-per-node {world}"  # the plan's nodes, when it spans several
        raise AutopipeError(
            f"{plan_path} has {plan.stages} stages but {pp_size * per_stage} processes were launched "
            f"({pp_size} per replica{_dp(dp_size)}{_tp(tp)}): launch with {how}{_dp(dp_size)}{_tp(tp)}."
        )


def _dp(dp: int) -> str:
    return f" with --dp {dp}" if dp > 1 else ""


def _tp(tp: int) -> str:
    return f" and --tp {tp}" if tp > 1 else ""


