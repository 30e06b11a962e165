"""Measured step time of a real 2-stage pipeline vs the simulator's prediction, same run.

    python bench/bench_runtime.py        # writes bench/results/runtime.{json,md}

A GPT-2-shaped model (8 blocks, width 256, vocabulary 8192: the embedding has many parameters but
little compute, the LM head much compute) is profiled on this CPU with one thread per process, then
partitioned for 2 stages twice: autopipe's plan (measured costs) and the parameter-count baseline
(DeepSpeed's default). Each plan is trained with the generated train.py under torchrun (gloo, one
thread per rank) and the median step time after warm-up is set against ``plan.step_time``.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

RESULTS = ROOT / "bench" / "results"
CONFIG = {"n_layer": 8, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 128}
ROWS, SEQ, MICRO, STEPS, WARMUP = 4, 128, 8, 14, 4


def make_folder(root: Path) -> Path:
    from transformers import GPT2Config

    folder = root / "gpt2-bench"
    GPT2Config(architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               bos_token_id=0, eos_token_id=0, use_cache=False, **CONFIG).save_pretrained(folder)
    return folder


def plans(folder: Path) -> dict:
    import autopipe
    from autopipe.graph.sources import load_model

    torch.set_num_threads(1)  # as each pipeline rank runs
    spec = load_model(str(folder), device="cpu", batch_size=ROWS, seq_len=SEQ, dropout=0.0)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
    prof = autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False)
    out = {}
    for method in ("autopipe", "parameters"):
        out[method] = autopipe.partition(prof, stages=2, microbatches=MICRO, schedule="1f1b", method=method)
    return out


def run_plan(job: Path, name: str, plan) -> list[float]:
    from autopipe.job.script import write_train_script
    from autopipe.job.settings import JobSettings

    run = job / name
    run.mkdir()
    plan.save(run / "plan.json")
    write_train_script(run / "train.py", JobSettings(model=str(job / "gpt2-bench"), stages=2, microbatches=MICRO, schedule="1f1b", batch_size=ROWS, seq_len=SEQ))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(run / "train.py"),
           "--steps", str(STEPS), "--log-json", str(run / "log.json"), "--ckpt-dir", str(run / "ckpt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1200, env=env)
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-2000:])
    records = [json.loads(line) for line in (run / "log.json").read_text().splitlines()]
    return [r["step_time"] for r in records[WARMUP:]]


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp)
        make_folder(job)
        found = plans(job / "gpt2-bench")
        rows = []
        for method, plan in found.items():
            times = run_plan(job, method, plan)
            measured = statistics.median(times)
            rows.append({
                "method": method, "boundaries": list(plan.boundaries), "predicted_step_s": plan.step_time,
                "predicted_bottleneck_s": plan.bottleneck_time, "measured_step_s": measured,
                "measured_spread_s": (max(times) - min(times)), "ratio_measured_to_predicted": measured / plan.step_time,
                "steps_timed": len(times),
            })
    base = {r["method"]: r for r in rows}
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                     "note": "2 processes x 1 thread, gloo; the machine is shared, so absolute times are noisy"},
        "model": dict(CONFIG, rows_per_microbatch=ROWS, seq_len=SEQ, microbatches=MICRO, schedule="1f1b"),
        "runs": rows,
        "measured_speedup_autopipe_vs_parameters": base["parameters"]["measured_step_s"] / base["autopipe"]["measured_step_s"],
        "predicted_speedup_autopipe_vs_parameters": base["parameters"]["predicted_step_s"] / base["autopipe"]["predicted_step_s"],
    }
    (RESULTS / "runtime.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Runtime: measured vs predicted step time (2-stage GPT-2-shaped model, CPU, 1F1B)",
        "",
        (f"Model {CONFIG}, {MICRO} micro-batches of {ROWS}x{SEQ} tokens; {len(rows[0]) and rows[0]['steps_timed']} "
        f"steps timed after {WARMUP} warm-up; 2 ranks x 1 thread, gloo. Shared machine: times are noisy."),
        "",
        "| plan | boundaries | predicted step (s) | measured step (s, median) | measured / predicted |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['method']} | {r['boundaries']} | {r['predicted_step_s']:.3f} | {r['measured_step_s']:.3f} | "
                     f"{r['ratio_measured_to_predicted']:.2f} |")
    lines += ["", (f"Speed-up of autopipe's plan over the parameter-count baseline: measured "
              f"{result['measured_speedup_autopipe_vs_parameters']:.2f}x, predicted "
              f"{result['predicted_speedup_autopipe_vs_parameters']:.2f}x."), ""]
    (RESULTS / "runtime.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
