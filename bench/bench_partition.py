"""Benchmark the partition solver, and compare baselines with autopipe on saved profiles.

    python bench/bench_partition.py            # writes bench/results/partition.{json,md}

1. Solver time (median of repeats) for 1k/10k/100k layers x 4/16/64 stages on synthetic costs with
   communication, without and with a binding memory limit (1F1B in-flight counts).
2. For profiles/gpt2-cpu.json (measured; skipped when absent) and any profiles/*-estimate.json: the
   bottleneck and step time of each baseline as a ratio to autopipe's, for several stage counts.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopipe.baselines import BASELINES  # noqa: E402
from autopipe.partition import partition  # noqa: E402
from autopipe.records import Profile  # noqa: E402
from autopipe.schedule import inflight_counts  # noqa: E402
from autopipe.solver import StageCosts, min_peak_memory, solve  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SIZES = (1_000, 10_000, 100_000)
STAGES = (4, 16, 64)


def synthetic(n: int, seed: int) -> dict:
    """Transformer-like layers: times 1-3 ms with a heavy tail, ~1 MB crossing each cut at 25 GB/s."""
    rng = np.random.default_rng(seed)
    times = rng.lognormal(mean=np.log(2e-3), sigma=0.3, size=n)
    cut = 2 * rng.uniform(0.5e6, 1.5e6, size=n - 1) / 25e9
    static = 4 * rng.integers(12_500_000, 37_500_000, size=n)  # float32 tensors: multiples of 4 bytes
    act = 4 * rng.integers(1_250_000, 3_750_000, size=n)
    return dict(compute=times, cut=cut, static=static, activation=act)


def time_solver(n: int, k: int, memory: bool, repeats: int) -> dict:
    data = synthetic(n, seed=n + k)
    costs = StageCosts(data["compute"], data["cut"], data["static"] if memory else None, data["activation"] if memory else None)
    inflight = inflight_counts("1f1b", k, 1, 2 * k) if memory else [1] * k
    limit = None
    if memory:  # between the least memory any cut needs and what the unconstrained optimum uses
        free = solve(costs, k, inflight=inflight)
        least = min_peak_memory(costs, k, inflight=inflight)
        limit = (least + free.peak_memory) // 2
    samples, probes = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        sol = solve(costs, k, inflight=inflight, limit=limit)
        samples.append(time.perf_counter() - t0)
        probes = sol.probes
    return {"layers": n, "stages": k, "memory_limit": memory, "median_s": statistics.median(samples),
            "samples_s": samples, "probes": probes}  # fmt: skip


def compare_profile(path: Path) -> dict:
    prof = Profile.load(path)
    n = len(prof.layers)
    rows = []
    for stages in (2, 4, 8):
        if stages > n:
            continue
        best = partition(prof, stages)
        row = {"stages": stages, "autopipe_bottleneck_s": best.bottleneck_time, "autopipe_step_s": best.step_time,
               "autopipe_boundaries": list(best.boundaries), "baselines": {}}  # fmt: skip
        for method in BASELINES:
            p = partition(prof, stages, method=method)
            row["baselines"][method] = {
                "bottleneck_ratio": p.bottleneck_time / best.bottleneck_time,
                "step_ratio": p.step_time / best.step_time,
                "boundaries": list(p.boundaries),
            }
        rows.append(row)
    return {"profile": str(path.relative_to(ROOT)), "model": prof.model, "mode": prof.mode,
            "device": prof.device.name, "layers": n, "rows": rows}  # fmt: skip


def main() -> None:
    quick = "--quick" in sys.argv
    timings = []
    for n in SIZES[:2] if quick else SIZES:
        for k in STAGES:
            for memory in (False, True):
                repeats = 3 if n >= 100_000 else 5
                r = time_solver(n, k, memory, repeats)
                print(f"{n:>7} layers x {k:>2} stages, memory limit {memory!s:>5}: {r['median_s']:.3f} s ({r['probes']} probes)", flush=True)
                timings.append(r)
    comparisons = []
    gpt2 = ROOT / "profiles" / "gpt2-cpu.json"
    paths = ([gpt2] if gpt2.exists() else []) + sorted((ROOT / "profiles").glob("*-estimate.json"))
    for path in paths:
        comparisons.append(compare_profile(path))
        print(f"compared baselines on {path.name}", flush=True)
    env = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg(), "gpt2_cpu_profile": gpt2.exists()}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "partition.json").write_text(json.dumps({"env": env, "solver": timings, "profiles": comparisons}, indent=1) + "\n")
    (RESULTS / "partition.md").write_text(_markdown(env, timings, comparisons))
    print(f"wrote {RESULTS / 'partition.md'}")


def _markdown(env: dict, timings: list[dict], comparisons: list[dict]) -> str:
    lines = ["# Partition benchmark", "",
             f"Python {env['python']}, numpy {env['numpy']}, {env['cpus']} CPUs ({env['machine']}); "
             f"load average at the end {env['load_average_at_end'][0]:.1f} (the machine is shared).", "",
             "## Solver time (median seconds; synthetic costs with communication)", "",
             "| layers | stages | no memory limit | binding memory limit (1F1B) |", "| ---: | ---: | ---: | ---: |"]  # fmt: skip
    by = {(r["layers"], r["stages"], r["memory_limit"]): r for r in timings}
    for n in sorted({r["layers"] for r in timings}):
        for k in STAGES:
            a, b = by.get((n, k, False)), by.get((n, k, True))
            if a and b:
                lines.append(f"| {n:,} | {k} | {a['median_s']:.3f} | {b['median_s']:.3f} |")
    lines += ["", "## Baselines against autopipe (bottleneck ratio; step-time ratio in brackets; 1F1B, M = 2S)", ""]
    if not comparisons:
        lines.append("No profile found (profiles/gpt2-cpu.json is produced by `autopipe profile gpt2`).")
    if not env["gpt2_cpu_profile"]:
        lines += ["", "profiles/gpt2-cpu.json (measured) was not there when this ran; only estimates are compared."]
    for comp in comparisons:
        lines += ["", f"### {comp['profile']} ({comp['mode']}, {comp['device']}, {comp['layers']} layers)", "",
                  "| stages | autopipe bottleneck ms | " + " | ".join(BASELINES) + " |",
                  "| ---: | ---: | " + " | ".join("---:" for _ in BASELINES) + " |"]  # fmt: skip
        for row in comp["rows"]:
            cells = [f"{row['baselines'][m]['bottleneck_ratio']:.3f} ({row['baselines'][m]['step_ratio']:.3f})" for m in BASELINES]
            lines.append(f"| {row['stages']} | {row['autopipe_bottleneck_s'] * 1e3:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
