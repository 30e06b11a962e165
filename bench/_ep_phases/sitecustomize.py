"""bench/bench_moe_ep_step.py's phase timers, loaded into an ep job's ranks only when the bench asks
(``PYTHONPATH`` holds this folder and ``AUTOPIPE_EP_PHASES`` names a file prefix): wall seconds of
every gloo all-to-all (forward and backward: torch's differentiable all-to-all calls the plain one),
of the count exchange, of each MoE layer's forward (dispatch + local experts + combine) and of its
local experts' forward alone, each call with its time stamp; written per rank at exit. The runtime
itself carries no timing code."""

from __future__ import annotations

import atexit
import json
import os
import time

_PREFIX = os.environ.get("AUTOPIPE_EP_PHASES")

if _PREFIX:
    import torch.distributed as dist

    _CALLS: dict[str, list[tuple[float, float]]] = {}

    def _timed(name, fn):  # noqa: ANN001, ANN202
        def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _CALLS.setdefault(name, []).append((t0, time.perf_counter() - t0))

        return run

    dist.all_to_all_single = _timed("all_to_all_single", dist.all_to_all_single)  # count exchange's too
    from autopipe.runtime.stage import expert_parallel as _ep

    _ep.exchange_counts = _timed("count_exchange", _ep.exchange_counts)
    _real = _ep.dispatch_combine

    def _layer(call, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if not getattr(call, "_phase_timed", False):
            call.run_local = _timed("local_experts_forward", call.run_local)
            call._phase_timed = True
        return _real(call, *args, **kwargs)

    _ep.dispatch_combine = _timed("moe_forward", _layer)

    @atexit.register
    def _dump() -> None:
        if not _CALLS:  # the launcher's own processes (torchrun's agent) load this too: nothing timed
            return
        rank = os.environ.get("RANK", "0")
        with open(f"{_PREFIX}{rank}.json", "w") as f:
            json.dump(_CALLS, f)
