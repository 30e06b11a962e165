"""Benchmark the partitioner end to end and the simulator, and compare baselines with autopipe on saved profiles.

    python bench/bench_partition.py            # writes bench/results/partition.{json,md}
    python bench/bench_partition.py --quick    # 1k and 10k layers only

1. Simulator: the former event loop (tests/_event_sim.py) against schedule.simulate (timeline
   included) and schedule.step_times (step only), median of repeats, per schedule and size.
2. partition() end to end (costs, search, bound, the Plan and its simulation) on synthetic layers
   with communication: without a memory limit, with a binding one (halfway between the least any
   cut needs and what the unconstrained plan uses), and with that limit and recompute="auto". The
   first call in a process also compiles the schedule's op graph; the median is of the calls after.
3. The interleaved example of issue 10, and the baselines against autopipe on profiles/*.json
   (step-time ratio first: the objective; bottleneck ratio beside it) with autopipe's proven gap.
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
sys.path.insert(0, str(ROOT / "tests"))  # the former event loop, kept there as the tests' oracle

from _event_sim import simulate_events  # noqa: E402

from autopipe.costs.layer_costs import LayerCost, Profile  # noqa: E402
from autopipe.planner.baselines import BASELINES  # noqa: E402
from autopipe.planner.partitioner import _Model, partition  # noqa: E402
from autopipe.planner.schedules import _program, simulate, step_times  # noqa: E402
from autopipe.planner.step_bound import least_memory  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "zbv")


def synthetic(n: int, seed: int) -> Profile:
    """Transformer-like layers: 1-3 ms with a heavy tail, ~1 MB crossing each cut (25 GB/s by default)."""
    rng = np.random.default_rng(seed)
    times = rng.lognormal(mean=np.log(2e-3), sigma=0.3, size=n)
    out = rng.integers(500_000, 1_500_000, size=n)
    params = 4 * rng.integers(3_125_000, 9_375_000, size=n)  # float32 tensors
    act = 4 * rng.integers(1_250_000, 3_750_000, size=n)
    layers = tuple(
        LayerCost(index=i, name=f"layer{i}", forward_time=float(t / 3), backward_time=float(2 * t / 3),
                  param_bytes=int(p), grad_bytes=int(p), optimizer_bytes=int(2 * p), activation_bytes=int(a),
                  output_bytes=int(o))  # fmt: skip
        for i, (t, p, a, o) in enumerate(zip(times, params, act, out))
    )
    return Profile(layers=layers, input_bytes=1_000_000)


def _median(fn, repeats: int) -> tuple[float, list[float]]:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples), samples


def _cpu_median(fn, repeats: int) -> float:
    """Median CPU seconds of this process: steadier than wall time while other jobs share the cores."""
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        samples.append(time.process_time() - t0)
    return statistics.median(samples)


def bench_simulator(sizes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    rng = np.random.default_rng(0)
    for ranks, m in sizes:
        for schedule in SCHEDULES:
            k = ranks * (2 if schedule in ("interleaved1f1b", "zbv") else 1)
            f = rng.uniform(0.5, 1.5, k)
            kw = dict(forward=f.tolist(), backward=(2 * f).tolist(), comm=[0.01] * k, ranks=ranks, microbatches=m)
            assert simulate(schedule, **kw) == simulate_events(schedule, **kw)  # identical, timelines included
            old, _ = _median(lambda: simulate_events(schedule, **kw), 1 if ranks * m > 2000 else 3)
            new, _ = _median(lambda: simulate(schedule, **kw), 5)
            only, _ = _median(lambda: step_times(schedule, forward=f[None], backward=2 * f[None], comm=np.full((1, k), 0.01),
                                                 ranks=ranks, microbatches=m), 5)  # fmt: skip
            rows.append({"schedule": schedule, "ranks": ranks, "microbatches": m, "ops": (3 if schedule == "zbv" else 2) * m * k,
                         "event_loop_s": old, "simulate_s": new, "step_times_s": only})  # fmt: skip
            print(f"simulate {schedule:>15} {ranks:>2} x {m:>3}: {old:.4f} s -> {new:.4f} s ({old / new:.0f}x), step only {only:.4f} s", flush=True)
    return rows


def bench_partition(n: int, stages: int, schedule: str, repeats: int) -> list[dict]:
    prof = synthetic(n, seed=n + stages)
    rows = []
    free = partition(prof, stages, schedule=schedule)
    model = _Model(prof, None, 25e9)
    v = free.virtual_stages
    least = least_memory(model.costs, stages * v, inflight=list(free.stage_inflight)) * v
    binding = (least + free.peak_memory) // 2
    for label, limit, recompute in (("none", None, "none"), ("binding", binding, "none"), ("binding", binding, "auto")):
        kw = dict(schedule=schedule, memory_limit=limit, recompute=recompute)
        _program.cache_clear()  # a cold first call: it compiles the schedule's op graph again
        t0 = time.perf_counter()
        plan = partition(prof, stages, **kw)
        first = time.perf_counter() - t0
        med, samples = _median(lambda: partition(prof, stages, **kw), repeats)
        cpu = _cpu_median(lambda: partition(prof, stages, **kw), repeats)
        rows.append({"layers": n, "stages": stages, "schedule": schedule, "memory_limit": label, "recompute": recompute,
                     "first_s": first, "median_s": med, "cpu_s": cpu, "samples_s": samples, "step_s": plan.step_time,
                     "lower_bound_s": plan.step_lower_bound, "gap": plan.step_gap,
                     "recomputed_chunks": sum(mode != "none" for mode in plan.stage_recompute)})  # fmt: skip
        print(f"partition {n:>6} x {stages:>2} {schedule:>15} limit {label:>7} recompute {recompute:>4}: "
              f"median {med:.3f} s, cpu {cpu:.3f} s (first {first:.3f} s), gap {plan.step_gap:.4%}", flush=True)  # fmt: skip
    return rows


def interleaved_example() -> dict:
    prof = Profile.from_costs([2, 5, 1, 2, 8, 3])
    kw = dict(virtual_stages=2, microbatches=4, schedule="interleaved1f1b", bandwidth=None)
    plan = partition(prof, 2, **kw)
    old = partition(prof, 2, boundaries=[0, 3, 4, 5, 6], **kw)  # what the slowest-chunk objective returned
    return {"autopipe": list(plan.boundaries), "autopipe_step": plan.step_time, "gap": plan.step_gap,
            "slowest_chunk_cut": list(old.boundaries), "slowest_chunk_step": old.step_time}  # fmt: skip


def compare_profile(path: Path) -> dict:
    prof = Profile.load(path)
    n = len(prof.layers)
    rows = []
    for stages in (2, 4, 8):
        if stages > n:
            continue
        # no memory limit: this compares the cuts' step times (a GPU profile would otherwise be held
        # to its device's memory by default, which a 13B or 70B model does not fit on 2 stages)
        t0 = time.perf_counter()
        best = partition(prof, stages, memory_limit=None)
        seconds = time.perf_counter() - t0
        row = {"stages": stages, "autopipe_step_s": best.step_time, "autopipe_bottleneck_s": best.bottleneck_time,
               "autopipe_gap": best.step_gap, "autopipe_seconds": seconds, "autopipe_boundaries": list(best.boundaries),
               "baselines": {}}  # fmt: skip
        for method in BASELINES:
            p = partition(prof, stages, method=method, memory_limit=None)
            row["baselines"][method] = {"step_ratio": p.step_time / best.step_time,
                                        "bottleneck_ratio": p.bottleneck_time / best.bottleneck_time,
                                        "boundaries": list(p.boundaries)}  # fmt: skip
        rows.append(row)
    return {"profile": str(path.relative_to(ROOT)), "model": prof.model, "mode": prof.mode, "device": prof.device.name,
            "layers": n, "rows": rows}  # fmt: skip


def main() -> None:
    quick = "--quick" in sys.argv
    load_start = os.getloadavg()
    sim = bench_simulator([(8, 16), (32, 64), (64, 128)])
    parts = []
    for n in (1_000, 10_000) if quick else (1_000, 10_000, 100_000):
        for stages in (4, 16, 64):
            for schedule in SCHEDULES if (n, stages) == (10_000, 64) else ("1f1b",):
                parts += bench_partition(n, stages, schedule, repeats=3 if n >= 100_000 else 5)
    example = interleaved_example()
    comparisons = []
    gpt2 = ROOT / "profiles" / "gpt2-cpu.json"
    for path in ([gpt2] if gpt2.exists() else []) + sorted((ROOT / "profiles").glob("*-estimate.json")):
        comparisons.append(compare_profile(path))
        print(f"compared baselines on {path.name}", flush=True)
    env = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
           "gpt2_cpu_profile": gpt2.exists()}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = {"env": env, "simulator": sim, "partition": parts, "interleaved_example": example, "profiles": comparisons}
    (RESULTS / "partition.json").write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / "partition.md").write_text(_markdown(data))
    print(f"wrote {RESULTS / 'partition.md'}")


def _markdown(data: dict) -> str:
    env = data["env"]
    lines = ["# Partition benchmark", "",
             f"Python {env['python']}, numpy {env['numpy']}, {env['cpus']} CPUs ({env['machine']}). The machine is shared "
             f"with other engineers' jobs: load average {env['load_average_at_start'][0]:.1f} at the start, "
             f"{env['load_average_at_end'][0]:.1f} at the end, so single runs vary by tens of percent; medians of repeats.", "",
             "## Simulator: former event loop vs compiled recurrence (same floats, timelines included)", "",
             "| schedule | ranks x micro-batches | ops | event loop s | simulate s | speed-up | step_times s (step only) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in data["simulator"]:
        lines.append(f"| {r['schedule']} | {r['ranks']} x {r['microbatches']} | {r['ops']:,} | {r['event_loop_s']:.4f} | "
                     f"{r['simulate_s']:.4f} | {r['event_loop_s'] / r['simulate_s']:.0f}x | {r['step_times_s']:.4f} |")  # fmt: skip
    lines += ["", "## partition() end to end (median wall seconds / median CPU seconds of the process; a cold first call, "
              "compiling the op graph, in brackets)", "",
              "Synthetic transformer-like layers with communication at 25 GB/s. Binding limit: halfway between the least "
              "memory any cut needs and what the unconstrained plan uses. Gap: step over the proven lower bound, minus 1. "
              "CPU seconds are steadier than wall seconds while other jobs share the cores.", "",
              "| layers | stages | schedule | no limit | gap | binding limit | gap | binding + recompute auto | gap | chunks recomputed |",
              "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    by = {}
    for r in data["partition"]:
        by.setdefault((r["layers"], r["stages"], r["schedule"]), {})[(r["memory_limit"], r["recompute"])] = r
    for (n, k, schedule), rs in by.items():
        cells = []
        for key in (("none", "none"), ("binding", "none"), ("binding", "auto")):
            r = rs[key]
            cells += [f"{r['median_s']:.3f} / {r['cpu_s']:.3f} ({r['first_s']:.3f})", f"{r['gap']:.2%}"]
        lines.append(f"| {n:,} | {k} | {schedule} | " + " | ".join(cells) + f" | {rs[('binding', 'auto')]['recomputed_chunks']} |")
    ex = data["interleaved_example"]
    lines += ["", "## Issue 10's interleaved example", "",
              "Layer times [2, 5, 1, 2, 8, 3], 2 stages x 2 virtual, 4 micro-batches, interleaved1f1b: the slowest-chunk "
              f"objective returned {tuple(ex['slowest_chunk_cut'])}, step {ex['slowest_chunk_step']:.2f}; autopipe now returns "
              f"{tuple(ex['autopipe'])}, step {ex['autopipe_step']:.2f} ({ex['slowest_chunk_step'] / ex['autopipe_step']:.2f}x), "
              f"proven optimal (gap {ex['gap']:.0%})."]  # fmt: skip
    lines += ["", "## Baselines against autopipe (1F1B, M = 2S): step-time ratio (bottleneck ratio in brackets)", ""]
    if not data["profiles"]:
        lines.append("No profile found (profiles/gpt2-cpu.json is produced by `autopipe profile gpt2`).")
    if not env["gpt2_cpu_profile"]:
        lines += ["", "profiles/gpt2-cpu.json (measured) was not there when this ran; only estimates are compared."]
    for comp in data["profiles"]:
        lines += ["", f"### {comp['profile']} ({comp['mode']}, {comp['device']}, {comp['layers']} layers)", "",
                  "| stages | autopipe step ms | gap | " + " | ".join(BASELINES) + " |",
                  "| ---: | ---: | ---: | " + " | ".join("---:" for _ in BASELINES) + " |"]  # fmt: skip
        for row in comp["rows"]:
            cells = [f"{row['baselines'][m]['step_ratio']:.3f} ({row['baselines'][m]['bottleneck_ratio']:.3f})" for m in BASELINES]
            lines.append(f"| {row['stages']} | {row['autopipe_step_s'] * 1e3:.2f} | {row['autopipe_gap']:.2%} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
