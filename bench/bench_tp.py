"""Tensor parallelism on this CPU: the tp 2 plan's predictions against its job, beside tp 1's, and the
collective term alone.

    python bench/bench_tp.py            # writes bench/results/tp.md and tp.json

1. A Llama-shaped model (bench_accuracy's "llama": 6 layers, hidden 256, 4 heads, 2 KV heads, vocab 4096;
   4 x 128 tokens per micro-batch, 4 micro-batches, 1 stage) is converted at tp 1 and at tp 2
   (``autopipe convert --tp``: the cut solved on ``autopipe.costs.tp.at_tp``, the profile one tp rank
   sees) and trained by its train.py under torchrun (1 and 2 processes, gloo, one thread each). The
   whole step (median after warm-up, min-max beside it) and each rank's peak memory (a second run
   under ``--exact-memory``) are set against plan.json's ``total_step_time`` and ``rank_memory``.
2. The collective tp adds: a gloo all-reduce of each size the tp 2 profile's layers all-reduce
   (b·s·h·4 bytes), median of 30 on the same two processes, against ``ring_all_reduce`` at the
   bandwidth and latency the plan priced it with.
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
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"
ROWS, SEQ, MICRO, STEPS, WARMUP = 4, 128, 4, 8, 3

ALLREDUCE = r'''
import json, os, statistics, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.set_num_threads(1)
out = {}
for nbytes in json.loads(sys.argv[1]):
    x = torch.ones(nbytes // 4)
    for _ in range(5):
        dist.all_reduce(x)
    times = []
    for _ in range(30):
        dist.barrier()
        t = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - t)
    out[nbytes] = [statistics.median(times), min(times), max(times)]
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
'''


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def convert(folder: Path, tp: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "autopipe", "convert", str(folder), "--stages", "1", "--tp", str(tp), "--batch-size",
           str(ROWS), "--seq-len", str(SEQ), "--microbatches", str(MICRO), "--schedule", "1f1b", "--out", str(out), "--force"]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"convert --tp {tp} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads((out / "plan.json").read_text())


def train(job: Path, tp: int, *, exact_memory: bool = False) -> list[dict]:
    log = job / ("memory.json" if exact_memory else "log.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", str(job / "train.py"),
           "--steps", str(12 if exact_memory else STEPS), "--log-json", str(log), *(["--exact-memory"] if exact_memory else [])]
    done = subprocess.run(cmd, cwd=job, env=_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"train tp {tp} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    from autopipe.report.steplog import read_step_log

    return read_step_log(log)


def allreduce(sizes: list[int]) -> dict[int, list[float]]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(ALLREDUCE)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", f.name,
                           json.dumps(sizes)], env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return {int(k): v for k, v in json.loads(line[7:]).items()}


def main() -> None:
    from bench_accuracy import make_folder

    from autopipe.costs.layer_costs import Profile
    from autopipe.costs.tp import TP_LATENCY, ring_all_reduce

    load = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="autopipe-tp-"))
    folder = make_folder(root, "llama")
    rows = []
    for tp in (1, 2):
        job = root / f"tp{tp}"
        plan = convert(folder, tp, job)
        records = train(job, tp)
        tokens = ROWS * SEQ * MICRO
        steps = [tokens / r["tokens_per_s"] for r in records[WARMUP:]]
        memory = train(job, tp, exact_memory=True)
        peaks = [max(r.get("peak_memory") or [0]) for r in memory[4:]]  # every rank's, from the 5th step on
        predicted = plan["step_time"] + plan.get("step_overhead", 0.0)
        rows.append({"tp": tp, "predicted_step": predicted, "measured_step": statistics.median(steps),
                     "step_range": [min(steps), max(steps)], "predicted_peak": max(plan["rank_memory"]),
                     "measured_peak": max(peaks) if peaks else None, "boundaries": plan["boundaries"]})
        print(rows[-1], flush=True)
    prof = Profile.load(root / "tp2" / "profile.json")
    sizes = sorted({int(b) for l in prof.layers if l.tp is not None for b in (*l.tp.allreduce_forward,
                                                                                *l.tp.allreduce_backward)})  # fmt: skip
    measured = allreduce(sizes)
    bw = 5e9  # the CPU link the plan priced tp's collectives at (autopipe.cluster.topology.LINKS["cpu"])
    coll = [{"bytes": n, "measured": measured[n][0], "range": measured[n][1:], "predicted": ring_all_reduce(n, 2, bw, TP_LATENCY)}
            for n in sizes]  # fmt: skip
    after = os.getloadavg()[0]
    RESULTS.joinpath("tp.json").write_text(json.dumps({"load": [load, after], "jobs": rows, "allreduce": coll}, indent=1))
    lines = ["# Tensor parallelism on this CPU: the tp 2 plan against its job (bench/bench_tp.py)", "",
             f"Llama-shaped (6 layers, hidden 256, 4 heads, 2 KV heads, vocab 4096), {MICRO} micro-batches of {ROWS} x "
             f"{SEQ} tokens, 1 stage, gloo, one thread per process; load {load:.1f} before, {after:.1f} after.", "",
             "| tp | predicted step | measured step (min-max) | measured / predicted | predicted peak | measured peak |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = r["measured_step"] / r["predicted_step"]
        peak = f"{r['measured_peak'] / 2**20:.0f} MiB" if r["measured_peak"] else "n/a"
        lines.append(f"| {r['tp']} | {r['predicted_step']:.3f} s | {r['measured_step']:.3f} s ({r['step_range'][0]:.3f}-"
                     f"{r['step_range'][1]:.3f}) | {ratio:.2f} | {r['predicted_peak'] / 2**20:.0f} MiB | {peak} |")
    lines += ["", "The all-reduce tp adds, alone (2 processes, gloo, median of 30):", "",
              "| bytes | predicted | measured (min-max) | measured / predicted |", "| ---: | ---: | ---: | ---: |"]
    for c in coll:
        lines.append(f"| {c['bytes']:,} | {c['predicted'] * 1e3:.3f} ms | {c['measured'] * 1e3:.3f} ms "
                     f"({c['range'][0] * 1e3:.3f}-{c['range'][1] * 1e3:.3f}) | {c['measured'] / c['predicted']:.1f} |")
    RESULTS.joinpath("tp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
