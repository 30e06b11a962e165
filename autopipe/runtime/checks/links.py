"""This CPU host's collectives, measured: gloo's latency and bandwidth per collective, for a CPU profile.

A CPU job's ranks talk through gloo over the loopback, whose per-collective latency is not NVLink's
~10-20 µs (autopipe/costs/tp.py, ep.py) but some hundreds of µs, and whose bandwidth is no stated
figure. So a CPU profile carries its host's own (``DeviceInfo.links``: collective -> (α seconds,
β bytes/s)), and the costs price tp's all-reduces, ep's all-to-alls and ep's count exchange with
them (autopipe/costs/links.py reads them; a GPU profile keeps the stated NVLink/IB figures).

The probe: 2 processes under torchrun, one thread each as a job's CPU ranks run, gloo; each
collective timed at a few sizes (each call after a barrier, the slower rank's time, the
collectives and sizes interleaved), the median per size; α and β fitted to ``t = α + c·B/β`` by least squares on the relative error, ``c`` the
collective's own ring factor at 2 ranks (all-reduce 2(t−1)/t = 1, the rest (t−1)/t = 1/2), so
``costs.tp.ring_all_reduce(B, 2, β, α)`` is the measured time. The ep runtime's count exchange
(autopipe/runtime/stage/expert_parallel.exchange_counts: an all-to-all of E integers and two host
reads) is timed as it is, its median its latency. bench/bench_gloo_links.py runs the same worker
over 1 KiB - 16 MiB and says how well the fit holds per size (bench/results/gloo-links.md).

Measured once per host (its CPU, torch version) and cached in ``$AUTOPIPE_CACHE/links.json``
(default ``~/.cache/autopipe``), as the runtime reserve is; about 5 s, most of it torchrun starting.

    python -m autopipe.runtime.checks.links            # the cached figures, measured the first time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from ..process.launch import run_local_workers

__all__ = ["KINDS", "PROBE_SIZES", "fit_link", "host_links", "measure_links", "ring_factor"]

KINDS: tuple[str, ...] = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter")
COUNT = "count_exchange"  # the ep runtime's count exchange: a latency alone
PROBE_SIZES: tuple[int, ...] = (4 << 10, 64 << 10, 1 << 20, 4 << 20)  # bytes; the bench spans 1 KiB - 16 MiB
PROBE_REPS = 15
WORLD = 2
EXPERTS = 8  # the count exchange's E (its time hardly depends on it: 8 or 64 integers)


def ring_factor(kind: str, world: int) -> float:
    """The bytes through each rank's link per byte of the whole tensor (``B`` in the costs' formulas):
    2(t−1)/t for an all-reduce, (t−1)/t for an all-to-all (its balanced send), all-gather and
    reduce-scatter (``B`` the gathered / scattered whole)."""
    return (2.0 if kind == "all_reduce" else 1.0) * (world - 1) / world


def fit_link(medians: dict[int, float], kind: str, world: int) -> tuple[float, float]:
    """(α seconds, β bytes/s) of ``t = α + c·B/β`` fitted to ``medians`` (bytes -> seconds) by least
    squares on the relative error (a 16 MiB call's milliseconds must not drown a 1 KiB call's µs);
    α at least 0, β inf where the times do not grow with the bytes.

    Example:
        >>> a, b = fit_link({1000: 1e-4 + 1000 / 1e9, 10**6: 1e-4 + 10**6 / 1e9}, "all_reduce", 2)
        >>> round(a * 1e6, 3), round(b / 1e9, 3)
        (100.0, 1.0)
    """
    c = ring_factor(kind, world)
    xs = sorted(medians)
    # minimise sum ((α + s·c·B − t) / t)²: weighted linear least squares in (α, s), s = 1/β
    w = [1.0 / medians[b] ** 2 for b in xs]
    sw = sum(w)
    sx = sum(wi * c * b for wi, b in zip(w, xs))
    sxx = sum(wi * (c * b) ** 2 for wi, b in zip(w, xs))
    sy = sum(wi * medians[b] for wi, b in zip(w, xs))
    sxy = sum(wi * c * b * medians[b] for wi, b in zip(w, xs))
    det = sw * sxx - sx * sx
    slope = (sw * sxy - sx * sy) / det if det > 0 else 0.0
    alpha = (sy - slope * sx) / sw
    if alpha < 0.0:  # refit through the origin: no negative latency
        alpha, slope = 0.0, sxy / sxx
    if slope <= 0.0:
        return max(statistics.median(medians.values()), 0.0), float("inf")
    return alpha, 1.0 / slope


def _cache_file() -> Path:
    root = os.environ.get("AUTOPIPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "autopipe")
    return Path(root) / "links.json"


def _key() -> str:
    import torch

    from ...costs.devices import cpu_name

    return f"cpu|{cpu_name()}|gloo x{WORLD}, 1 thread|torch {torch.__version__}"


def measure_links(sizes: Sequence[int] = PROBE_SIZES, reps: int = PROBE_REPS, world: int = WORLD,
                  kinds: Sequence[str] = KINDS) -> dict[str, Any]:  # fmt: skip
    """Time ``kinds`` at ``sizes`` bytes on ``world`` gloo processes (and the count exchange): per kind
    its per-call seconds by size (the slower rank's), the fitted (α, β), and the count exchange's times."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "links.json"
        args = [str(out), "--sizes", ",".join(map(str, sizes)), "--reps", str(reps), "--kinds", ",".join(kinds)]
        run_local_workers("autopipe.runtime.checks.links", world, args, timeout=600,
                          failure="measuring this host's gloo collectives failed")  # fmt: skip
        raw = json.loads(out.read_text())
    figures: dict[str, Any] = {"world": world, "times": raw, "links": {}}
    for kind in kinds:
        medians = {int(b): statistics.median(ts) for b, ts in raw[kind].items()}
        figures["links"][kind] = list(fit_link(medians, kind, world))
    figures["links"][COUNT] = [statistics.median(raw[COUNT]), 0.0]
    return figures


def host_links(refresh: bool = False) -> dict[str, tuple[float, float]]:
    """This host's gloo figures (collective -> (α s, β bytes/s); the count exchange's β is 0): cached,
    else measured by :func:`measure_links` and cached."""
    path, key = _cache_file(), _key()
    cache: dict[str, Any] = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    if key not in cache or refresh:
        cache[key] = measure_links()["links"]
        try:
            from ...files import write_text_atomic

            write_text_atomic(path, json.dumps(cache, indent=1) + "\n")
        except OSError:
            pass  # a read-only home: measure again next time
    return {k: (float(a), float(b)) for k, (a, b) in cache[key].items()}


def _worker(out: Path, sizes: list[int], reps: int, kinds: list[str]) -> None:
    """One probe rank: every (collective, size) timed ``reps`` times after 3 warm-ups, a barrier before
    each call, the call alone timed, the pairs interleaved (a burst of the host's other work then
    slows some calls of every size, not all calls of one: the fit's sizes stay comparable); rank 0
    writes the slower rank's seconds per call."""
    import torch
    import torch.distributed as dist

    from ..stage.expert_parallel import exchange_counts

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    calls: dict[tuple[str, int], Any] = {}
    for nbytes in sizes:
        n = max(world, nbytes // 4 // world * world)  # float32 elements, divisible by the world
        x, y, part = torch.randn(n), torch.empty(n), torch.empty(n // world)
        ops = {"all_to_all": lambda x=x, y=y: dist.all_to_all_single(y, x),
               "all_reduce": lambda x=x: dist.all_reduce(x.normal_()),  # summed in place: kept finite
               "all_gather": lambda y=y, part=part: dist.all_gather_into_tensor(y, part),
               "reduce_scatter": lambda x=x, part=part: dist.reduce_scatter_tensor(part, x)}  # fmt: skip
        for kind in kinds:
            calls[(kind, n * 4)] = ops[kind]
    counts = torch.randint(0, 64, (EXPERTS,))
    calls[(COUNT, 0)] = lambda: exchange_counts(counts, world, None)
    for fn in calls.values():
        for _ in range(3):
            fn()
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for _ in range(reps):
        for key, fn in calls.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    keys = list(times)
    both = torch.tensor([times[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    raw: dict[str, Any] = {k: {} for k in kinds}
    for (kind, nbytes), row in zip(keys, both.tolist()):
        if kind == COUNT:
            raw[COUNT] = row
        else:
            raw[kind][str(nbytes)] = row
    if rank == 0:
        out.write_text(json.dumps(raw))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure this host's gloo collectives (latency, bandwidth).")
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # a probe rank under torchrun
    parser.add_argument("--sizes", default=",".join(map(str, PROBE_SIZES)), help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=PROBE_REPS, help=argparse.SUPPRESS)
    parser.add_argument("--kinds", default=",".join(KINDS), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        _worker(Path(opts.worker), [int(s) for s in opts.sizes.split(",")], opts.reps, opts.kinds.split(","))
        return
    print(json.dumps(host_links(refresh=opts.refresh)))


if __name__ == "__main__":
    main()
