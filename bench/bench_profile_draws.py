"""How much does a plan's predicted step move from one profile to the next, and the measured step?

    python bench/bench_profile_draws.py                 # GPT-2 and Llama (bench_accuracy's), 10 rounds each
    python bench/bench_profile_draws.py --rounds 3 --models gpt2 --no-write   # a quick look

A plan is costed from one profile, so everything a profile draws by chance (each layer's span inside
the whole model comes from that profile's few whole-model runs) moves every plan made from it
together: in bench/bench_accuracy.py all six GPT-2 jobs read 1.04-1.08 in one run and 0.99-1.04 in
the next with the same code. This bench measures that draw. Each round profiles the model twice,
with ``A`` and then ``B`` whole-model runs (the profiler's own count is 1.5 x its repeats: 15 by
default; before, half: 5), predicts the step of one fixed job (bench_accuracy's configuration, cut
by the first profile) from each, then runs that job (torchrun, 2 gloo ranks, one thread each) and
takes its median whole step. So each round's two predictions and its measurement meet the same
machine minutes apart.

Reported per model and count: the predicted step's median and coefficient of variation over the
rounds, the measured step's, and measured / predicted (median, range, rounds within ±5 %). Records
to bench/results/profile-draws.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import bench_accuracy as ba  # noqa: E402
from _notes import write_keeping_notes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CONFIG = {"gpt2": "gpt2-pp2-1f1b-fp32-none", "llama": "llama-pp2-1f1b-fp32-none"}


@contextlib.contextmanager
def whole_model_runs(runs: int) -> Iterator[None]:
    """The profiler takes ``runs`` whole-model runs inside this block, whatever its repeats."""
    import autopipe.costs.profiler as profiler

    original = profiler.time_in_model
    profiler.time_in_model = lambda layers, x, *, device, warmup, repeats: original(
        layers, x, device=device, warmup=warmup, repeats=runs)
    try:
        yield
    finally:
        profiler.time_in_model = original


def cv(values: list[float]) -> float:
    return statistics.pstdev(values) / statistics.mean(values) if len(values) > 1 else 0.0


def measure(model: str, rounds: int, counts: tuple[int, int], root: Path) -> list[dict]:
    cfg = next(c for c in ba.CONFIGS if c.name == CONFIG[model])
    folder = ba.make_folder(root, cfg.model)
    traced = ba.traced(folder, cfg)
    job, cut, rows = None, None, []
    for r in range(rounds):
        load, predicted = os.getloadavg()[0], {}
        for runs in counts:
            with whole_model_runs(runs):
                prof = ba.profile_of(traced, cfg)
            if job is None:  # the job (and its cut) from the first profile; every later plan costs that cut
                plan = ba.plan_for(prof, cfg)
                cut = list(plan.boundaries)  # type: ignore[attr-defined]
                job = ba.write_job(root, folder, cfg, prof, plan)
            predicted[runs] = ba.plan_for(prof, cfg, cut).total_step_time  # type: ignore[attr-defined]
        records = ba.run_job(job, cfg)
        (job / "log.json").unlink()
        measured = statistics.median(ba.whole_steps(records, cfg))
        row = {"model": model, "config": cfg.name, "round": r, "cut": cut, "load": load, "measured": measured,
               "predicted": {str(k): v for k, v in predicted.items()}}  # fmt: skip
        rows.append(row)
        print(f"{model} round {r}: measured {measured:.4f} s; predicted "
              + ", ".join(f"{k} runs {v:.4f} s ({measured / v:.3f})" for k, v in predicted.items())
              + f"; load {load:.1f}", flush=True)  # fmt: skip
    return rows


def summary(rows: list[dict], counts: tuple[int, int]) -> list[dict]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        measured = [r["measured"] for r in mine]
        for k in counts:
            pred = [r["predicted"][str(k)] for r in mine]
            ratios = [m / p for m, p in zip(measured, pred)]
            out.append({"model": model, "config": mine[0]["config"], "runs": k, "rounds": len(mine),
                        "predicted_median": statistics.median(pred), "predicted_cv": cv(pred),
                        "measured_median": statistics.median(measured), "measured_cv": cv(measured),
                        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                        "within_5": sum(abs(x - 1) <= 0.05 for x in ratios)})  # fmt: skip
    return out


def write(rows: list[dict], table: list[dict], counts: tuple[int, int], started: str) -> None:
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "started": started, "load_end": os.getloadavg()[0], "counts": list(counts)}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "profile-draws.json").write_text(json.dumps({"meta": meta, "summary": table, "rounds": rows}, indent=1) + "\n")
    loads = [r["load"] for r in rows]
    lines = [
        "# Profile draws: how far one profile's plan moves from the next's",
        "",
        f"`python bench/bench_profile_draws.py`; started {started}; {meta['cpus']} CPUs, one thread per rank; load "
        f"{min(loads):.1f}-{max(loads):.1f} at the rounds' starts. Each round: a profile with {counts[0]} whole-model "
        f"runs, one with {counts[1]}, each costing the same job (cut by the first profile), then that job's median "
        f"whole step ({ba.STEPS} steps, the first {ba.WARMUP} skipped).",
        "",
        "| configuration | whole-model runs | rounds | predicted step (median, CV) | measured step (median, CV) | measured / predicted (median, range) | rounds within ±5 % |",
        "| --- | ---: | ---: | --- | --- | --- | ---: |",
    ]
    for t in table:
        lines.append(f"| {t['config']} | {t['runs']} | {t['rounds']} | {t['predicted_median']:.4f} s ({t['predicted_cv']:.1%}) | "
                     f"{t['measured_median']:.4f} s ({t['measured_cv']:.1%}) | {t['ratio_median']:.3f} "
                     f"({t['ratio_min']:.3f}-{t['ratio_max']:.3f}) | {t['within_5']} |")  # fmt: skip
    write_keeping_notes(RESULTS / "profile-draws.md", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2,llama", help="comma-separated: gpt2, llama")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--counts", default="5,15", help="the two whole-model run counts compared")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results alone")
    opts = parser.parse_args()
    a, b = (int(x) for x in opts.counts.split(","))
    import tempfile

    started = time.strftime("%Y-%m-%d %H:%M")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in opts.models.split(","):
            rows += measure(model, opts.rounds, (a, b), Path(tmp))
    table = summary(rows, (a, b))
    for t in table:
        print(f"{t['config']:<28} {t['runs']:>2} runs: predicted cv {t['predicted_cv']:.1%}, ratio {t['ratio_median']:.3f} "
              f"({t['ratio_min']:.3f}-{t['ratio_max']:.3f}), {t['within_5']}/{t['rounds']} within 5%")  # fmt: skip
    if not opts.no_write:
        write(rows, table, (a, b), started)


if __name__ == "__main__":
    main()
