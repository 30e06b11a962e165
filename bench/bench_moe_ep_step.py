"""ep 2 jobs on this CPU: does the measured step follow the skewed prediction or the balanced one?

For each tiny Mixtral of tests/moe_skew_models.py (routers biased toward two experts, and untouched):
``convert --stages 1 --dp 2 --ep 2`` (two processes: one per core, so the step measures the job, not
the machine's contention), whose plan prices the experts at the profile's p95 skew (autopipe/costs/ep.py);
the same cut priced balanced (``node_ep_view(..., skew="balanced")``); then the job trains STEPS steps
and the median step after WARMUP is set against both predictions. One ep group: each rank holds 4 of
the 8 experts and the busiest rank's share of the slots sets the step.

    python bench/bench_moe_ep_step.py     # -> bench/results/moe-ep-step.{json,md}
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
EP, DP, STAGES, MICRO, STEPS, WARMUP = 2, 2, 1, 4, 24, 6


def _run(name: str, work: Path) -> dict:
    from autopipe import Profile, partition
    from autopipe.cluster.evaluate import node_ep_view
    from autopipe.job.converter import convert

    job = work / name
    result = convert(f"tests/moe_skew_models.py:{name}", stages=STAGES, dp=DP, ep=EP, microbatches=MICRO, seq_len=32,
                     out=job, progress=False, schedule="1f1b")  # fmt: skip
    plan, whole = result.plan, Profile.load(job / "profile.json")
    balanced = partition(node_ep_view(whole, EP, gpus=STAGES * DP, dp=DP, skew="balanced"), STAGES,
                         microbatches=MICRO, dp=DP, boundaries=plan.boundaries, schedule=plan.schedule)  # fmt: skip
    # the job's ranks initialise a factory's weights afresh (runtime/stage/weights.py): the biased
    # routers come from the factory's own model, saved
    import moe_skew_models as M
    from safetensors.torch import save_file

    model = getattr(M, name)()[0]
    weights = job / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    log = job / "log.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "autopipe", "run", str(job), "--steps", str(STEPS), "--log-json", str(log),
                           "--weights", str(weights)], cwd=job, env=env, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{name}: the ep job failed:\n{(done.stdout + done.stderr)[-3000:]}")
    times = [json.loads(line)["step_time"] for line in log.read_text().splitlines()][WARMUP:]
    q = statistics.quantiles(times, n=4)
    measured = statistics.median(times)
    return {"boundaries": list(plan.boundaries), "predicted_p95_s": plan.step_time,
            "predicted_balanced_s": balanced.step_time, "measured_median_s": measured, "measured_q1_s": q[0],
            "measured_q3_s": q[2], "ratio_to_p95": measured / plan.step_time,
            "ratio_to_balanced": measured / balanced.step_time, "steps": len(times)}  # fmt: skip


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {name: _run(name, Path(tmp)) for name in ("mixtral_skewed", "mixtral_balanced")}
    record = {"ep": EP, "dp": DP, "stages": STAGES, "microbatches": MICRO, "steps": STEPS, "warmup": WARMUP,
              "load_before": load_before, "load_after": os.getloadavg()[0], "runs": runs}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe-ep-step.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# ep 2 jobs on CPU: measured step against the skewed (p95) and the balanced prediction", "",
             f"`bench/bench_moe_ep_step.py`: {STAGES} stage × dp {DP}, ep {EP}, {MICRO} micro-batches, 1 thread per "
             f"rank, median of steps {WARMUP + 1}-{STEPS}; host load {load_before:.1f} before, "
             f"{record['load_after']:.1f} after (2 shared cores).", "",
             "| model | predicted p95 (ms) | predicted balanced (ms) | measured median (ms) [IQR] | measured / p95 | "
             "measured / balanced |", "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, r in runs.items():
        lines.append(f"| {name} | {r['predicted_p95_s'] * 1e3:.1f} | {r['predicted_balanced_s'] * 1e3:.1f} | "
                     f"{r['measured_median_s'] * 1e3:.1f} [{r['measured_q1_s'] * 1e3:.1f}-{r['measured_q3_s'] * 1e3:.1f}] | "
                     f"{r['ratio_to_p95']:.2f} | {r['ratio_to_balanced']:.2f} |")  # fmt: skip
    (RESULTS / "moe-ep-step.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
