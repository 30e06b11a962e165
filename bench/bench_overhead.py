"""What autopipe adds to an engine: its job against a bare script on the same engine and cut, many rounds.

    python bench/bench_overhead.py                       # Llama and GPT-2, 2 stages, both engines, 6 rounds
    python bench/bench_overhead.py --models llama --engines torch --rounds 8 --no-write

bench_peers.py compares eight methods in two rounds; a 3% question needs more rounds of two. Each
round runs autopipe's job and the bare script (bench/peers/hand_torch.py, hand_deepspeed.py) back to
back at autopipe's cut, alternating which goes first, so load drifts reach both alike. Reported per
pair: the median step over all rounds (steps 3-10 of rank 0), the median of the per-round ratios,
the CPU seconds per step of each rank, and the load. Results: bench/results/overhead.{md,json}
(``--out`` names another; notes under "## " headings survive a rerun). Needs a quiet machine: nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _notes import write_keeping_notes  # noqa: E402
from bench_peers import MODELS, blocks, load, make_jobs, run  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = 2


def _median_step(out: dict) -> float:
    return statistics.median(out["ranks"][0]["periods"][WARMUP:])


def _cpu(out: dict) -> list[float]:
    return [statistics.median(rk["cpu"][WARMUP:]) for rk in out["ranks"]]


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama,gpt2", help=f"a subset of {','.join(MODELS)}")
    ap.add_argument("--stages", default="2", help="stage counts, e.g. 2,4")
    ap.add_argument("--engines", default="torch,deepspeed")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10, help="steps per run; the first 2 are warm-up")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", default="overhead", help="results file name in bench/results (overhead-4 for a 4-stage run, say)")
    a = ap.parse_args()
    models, engines = a.models.split(","), a.engines.split(",")
    stage_counts = [int(x) for x in a.stages.split(",")]
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    started, t0 = load(), time.perf_counter()
    results: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_overhead_") as tmp:
        root = Path(tmp)
        for model in models:
            for stages, (job, cut, *_rest) in make_jobs(root, model, stage_counts).items():
                for engine in engines:
                    pair = [f"autopipe {engine}", f"bare {engine}"]
                    runs: dict[str, list[dict]] = {m: [] for m in pair}
                    for rnd in range(a.rounds):
                        for method in pair if rnd % 2 == 0 else pair[::-1]:
                            out = run(method, job, cut, stages, a.steps,
                                      root / "records" / f"{model}-{stages}-{rnd}-{method.replace(' ', '_')}")  # fmt: skip
                            runs[method].append(out)
                            print(f"{model} {stages} stages round {rnd + 1}/{a.rounds} {method:<18} "
                                  f"{_median_step(out):.3f} s  load {out['load'][0]:.1f}", flush=True)  # fmt: skip
                    row: dict = {"model": model, "stages": stages, "engine": engine, "cut": cut, "methods": {}}
                    for method in pair:
                        low, mid, high = _quartiles([p for out in runs[method] for p in out["ranks"][0]["periods"][WARMUP:]])
                        cpu = [_cpu(out) for out in runs[method]]
                        row["methods"][method] = {
                            "step": mid, "iqr": [low, high],
                            "per_round": [_median_step(out) for out in runs[method]],
                            "cpu_per_rank": [statistics.median(c[r] for c in cpu) for r in range(stages)],
                            "load": [x for out in runs[method] for x in out["load"]],
                        }  # fmt: skip
                    ours, bare = (row["methods"][m] for m in pair)
                    row["ratio"] = ours["step"] / bare["step"]
                    row["ratio_per_round"] = statistics.median(o / b for o, b in zip(ours["per_round"], bare["per_round"]))
                    results.append(row)
    finished = load()
    text = _table(results)
    print(text)
    seconds = time.perf_counter() - t0
    print(f"{seconds:.0f} s; load {started:.1f} -> {finished:.1f}; {uptime}")
    if not a.no_write:
        RESULTS.mkdir(exist_ok=True)
        doc = {"uptime": uptime, "load": [started, finished], "rounds": a.rounds, "steps": a.steps, "warmup": WARMUP,
               "seconds": seconds, "results": results}  # fmt: skip
        (RESULTS / f"{a.out}.json").write_text(json.dumps(doc, indent=1) + "\n")
        head = (f"# autopipe's job against a bare script on the same engine and cut (bench/bench_overhead.py)\n\n"
                f"{a.rounds} rounds of {a.steps} steps per method, alternating which runs first; median of steps "
                f"{WARMUP + 1}-{a.steps} of rank 0; {os.cpu_count()} CPUs, gloo, one thread per rank; `uptime` at the "
                f"start: {uptime}; load {started:.1f} -> {finished:.1f}; {seconds / 60:.0f} minutes.\n")  # fmt: skip
        write_keeping_notes(RESULTS / f"{a.out}.md", head + text)


def _table(results: list[dict]) -> str:
    lines = ["", "| model, stages | engine | layers per stage | autopipe step (IQR) | bare step (IQR) | ratio | "
             "median per-round ratio | CPU s/step per rank (autopipe / bare) | load |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in results:
        ours, bare = (row["methods"][f"{k} {row['engine']}"] for k in ("autopipe", "bare"))
        loads = ours["load"] + bare["load"]
        cpu = ", ".join(f"{o:.3f} / {b:.3f}" for o, b in zip(ours["cpu_per_rank"], bare["cpu_per_rank"]))
        lines.append(f"| {row['model']}, {row['stages']} | {row['engine']} | {blocks(row['cut'])} | "
                     f"{ours['step']:.3f} s ({ours['iqr'][0]:.3f}-{ours['iqr'][1]:.3f}) | "
                     f"{bare['step']:.3f} s ({bare['iqr'][0]:.3f}-{bare['iqr'][1]:.3f}) | {row['ratio']:.3f} | "
                     f"{row['ratio_per_round']:.3f} | {cpu} | {min(loads):.1f}-{max(loads):.1f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
