"""What every method of ``bench/bench_peers.py`` records, measured the same way in each process.

Each rank keeps the wall-clock time at which each of its steps returned and its process CPU time
then; at exit it writes them with its peak resident set (``VmHWM``: the whole process, as the OS
counts it) and, on the last rank, the step losses. Period i = end of step i - end of step i-1,
so data loading, logging and the optimizer of a step all count, for bare scripts and jobs alike.

With ``BENCH_PROFILE=N`` in the environment the steps after the first N run under ``torch.profiler``
(CPU), with the ranges of ``labels.install``, and the record carries their ``breakdown`` (seconds per
step per part). The profiler costs time: such a run is for the breakdown, not for the step time.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import time

__all__ = ["Recorder"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    return int(m.group(1)) if m else 0


class Recorder:
    """Per-rank step timestamps, CPU times and losses, written to ``$BENCH_RECORD_DIR/rank{R}.json``."""

    def __init__(self) -> None:
        self.folder = os.environ.get("BENCH_RECORD_DIR")
        self.rank = int(os.environ.get("RANK", "0"))
        self.ends: list[float] = [time.perf_counter()]
        self.cpu: list[float] = [time.process_time()]
        self.losses: list[float] = []
        self.extra: dict = {}
        self.profile_from = int(os.environ.get("BENCH_PROFILE", "-1"))
        self.prof = None
        if self.profile_from >= 0:
            from labels import install

            install()
        if self.folder:
            atexit.register(self.write)

    def start(self) -> None:
        """The loop starts now (the first step's period starts here)."""
        self.ends, self.cpu = [time.perf_counter()], [time.process_time()]

    def step(self, loss: float | None = None) -> None:
        self.ends.append(time.perf_counter())
        self.cpu.append(time.process_time())
        if loss is not None:
            self.losses.append(float(loss))
        if len(self.ends) - 1 == self.profile_from:
            import torch

            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
            self.profiled = len(self.ends)

    def _breakdown(self) -> None:
        from labels import breakdown

        self.prof.__exit__(None, None, None)
        steps = len(self.ends) - self.profiled
        if steps > 0:
            span = self.ends[-1] - self.ends[self.profiled - 1]
            self.extra["breakdown"] = {**breakdown(self.prof, steps), "step": span / steps}

    def write(self) -> None:
        if not self.folder:
            return
        if self.prof is not None:
            self._breakdown()
        out = {
            "rank": self.rank,
            "periods": [b - a for a, b in zip(self.ends, self.ends[1:])],
            "cpu": [b - a for a, b in zip(self.cpu, self.cpu[1:])],
            "losses": self.losses,
            "peak_rss": 1024 * _status_kib("VmHWM"),
            **self.extra,
        }
        with open(os.path.join(self.folder, f"rank{self.rank}.json"), "w") as f:
            json.dump(out, f)
