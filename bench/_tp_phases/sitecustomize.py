"""bench/bench_tp.py's per-term profile, loaded into a tp job's ranks only when the bench asks
(``PYTHONPATH`` holds this folder and ``AUTOPIPE_TP_PHASES`` names a file prefix): torch.profiler
over the trainer's steps FIRST..LAST-1 (CPU activity), its per-op totals (calls, self CPU seconds)
and the profiled steps' wall seconds written per rank at exit. The runtime carries no timing code."""

from __future__ import annotations

import atexit
import json
import os
import time

_PREFIX = os.environ.get("AUTOPIPE_TP_PHASES")
FIRST, LAST = 4, 7

if _PREFIX:
    import torch
    from autopipe.runtime.torch_engine import trainer as _trainer

    _real = _trainer.Trainer.step
    _state: dict = {"calls": 0, "walls": [], "ops": None}

    def step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        i = _state["calls"]
        _state["calls"] += 1
        if not FIRST <= i < LAST:
            return _real(self, *args, **kwargs)
        if i == FIRST:
            _state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            _state["prof"].__enter__()
        t0 = time.perf_counter()
        try:
            return _real(self, *args, **kwargs)
        finally:
            _state["walls"].append(time.perf_counter() - t0)
            if i == LAST - 1:
                prof = _state.pop("prof")
                prof.__exit__(None, None, None)
                _state["ops"] = [[e.key, e.count, e.self_cpu_time_total * 1e-6, e.cpu_time_total * 1e-6]
                                 for e in prof.key_averages()]

    _trainer.Trainer.step = step

    @atexit.register
    def _dump() -> None:
        if _state["ops"] is None:
            return
        with open(f"{_PREFIX}{os.environ.get('RANK', '0')}.json", "w") as f:
            json.dump({"walls": _state["walls"], "ops": _state["ops"]}, f)
