"""A memory-bound pipeline, side by side: autopipe's joint cut + recompute against the usual cuts.

    python bench/bench_showcase.py        # writes bench/results/showcase.{json,md}

A GPT-2-shaped model (a large vocabulary: heavy embedding and LM head, the layers DeepSpeed's
parameter count and a uniform layer count treat badly) is profiled on this CPU, then planned for 2
stages (1F1B) under a per-rank memory limit chosen so that the uniform and the parameter-count
cuts fit only with recompute on every stage, while autopipe, choosing cuts and recompute together,
recomputes less. The three plans (each baseline with the fastest recompute per stage that fits)
are trained by the same generated train.py, under torchrun, one after another in this run; the
measured median step time and each rank's peak memory are set beside the predictions.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
CONFIG = dict(n_layer=12, n_embd=192, n_head=4, vocab_size=16384, n_positions=128)
ROWS, SEQ, MICRO, STAGES, STEPS, WARMUP = 4, 128, 4, 2, 8, 2
METHODS = ("autopipe", "uniform", "parameters")


def profile_model(folder: Path):  # noqa: ANN201
    import torch

    import autopipe
    from autopipe.graph.sources import load_model
    from autopipe.runtime.checks.reserve import runtime_reserve

    torch.set_num_threads(1)  # as each rank runs
    spec = load_model(str(folder), device="cpu", batch_size=ROWS, seq_len=SEQ, dropout=0.0)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
    return autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False, reserve=runtime_reserve("cpu"))


def plans_at(prof, limit: int) -> dict:  # noqa: ANN001
    import autopipe
    from autopipe.errors import AutopipeError

    out = {}
    for method in METHODS:
        try:
            out[method] = autopipe.partition(prof, STAGES, microbatches=MICRO, schedule="1f1b", memory_limit=limit,
                                             recompute="auto", method=method)  # fmt: skip
        except AutopipeError:
            return {}
    return out


def showcase_limit(prof) -> tuple[int, dict]:  # noqa: ANN001
    """The largest limit (down from the unconstrained peak, in 1 MiB steps) at which both baselines
    fit only with recompute on every stage and autopipe fits with less recompute (seconds of
    recomputation per micro-batch) and a faster predicted step."""
    import autopipe

    free = autopipe.partition(prof, STAGES, microbatches=MICRO, schedule="1f1b", recompute="none")
    limit = int(free.peak_memory)
    while limit > 0:
        plans = plans_at(prof, limit)
        if plans:
            base = [plans[m] for m in METHODS[1:]]
            ours = plans["autopipe"]
            everywhere = all("none" not in p.stage_recompute for p in base)
            fit = all(p.peak_memory <= limit for p in plans.values())
            # less recompute: fewer seconds spent recomputing per micro-batch, summed over stages
            less = sum(ours.stage_recompute_time) < min(sum(p.stage_recompute_time) for p in base)
            if everywhere and fit and less and all(ours.step_time < p.step_time for p in base):
                return limit, plans
        limit -= 2**20
    raise SystemExit("no limit gives the showcase for this model: change CONFIG")


def train(job: Path, plan, name: str) -> list[dict]:  # noqa: ANN001
    from autopipe.job.folder import JobSettings, emit
    from autopipe.report.steplog import read_step_log

    settings = JobSettings(model=str(job / "model"), stages=STAGES, microbatches=MICRO, schedule="1f1b",
                           batch_size=ROWS, seq_len=SEQ)  # fmt: skip
    run = emit(job / name, settings=settings, profile=PROFILE, plan=plan, baselines={}).job_dir
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={STAGES}",
           str(run / "train.py"), "--steps", str(STEPS), "--log-json", str(run / "log.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return read_step_log(run / "log.json")


PROFILE = None


def main() -> None:
    global PROFILE
    from transformers import GPT2Config

    from autopipe.report.steplog import compare
    from autopipe.units import format_bytes

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        GPT2Config(architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                   bos_token_id=0, eos_token_id=0, **CONFIG).save_pretrained(root / "model")  # fmt: skip
        PROFILE = profile_model(root / "model")
        limit, plans = showcase_limit(PROFILE)
        rows = []
        for method in METHODS:
            plan = plans[method]
            cmp = compare(plan, train(root, plan, method), warmup=WARMUP)
            rows.append({"method": method, "boundaries": list(plan.boundaries), "recompute": list(plan.stage_recompute),
                         "recompute_s": list(plan.stage_recompute_time),
                         "predicted_step_s": plan.step_time, "measured_step_s": cmp.measured_step_time,
                         "step_iqr_s": cmp.step_time_spread, "predicted_memory": list(cmp.predicted_memory),
                         "measured_memory": list(cmp.measured_memory), "limit": limit})  # fmt: skip
            print(f"{method:<11} cuts {plan.boundaries} recompute {plan.stage_recompute}  step {cmp.measured_step_time:.3f}s "
                  f"(plan {plan.step_time:.3f})  peak {[format_bytes(m) for m in cmp.measured_memory]} "
                  f"(plan {[format_bytes(m) for m in cmp.predicted_memory]}, limit {format_bytes(limit)})", flush=True)
    write(rows, limit)


def write(rows: list[dict], limit: int) -> None:
    from autopipe.units import format_bytes

    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"cpus": os.cpu_count(), "python": platform.python_version(), "load_average_end": os.getloadavg()[0],
            "config": CONFIG, "rows": ROWS, "seq": SEQ, "microbatches": MICRO, "steps": STEPS, "warmup": WARMUP}  # fmt: skip
    (RESULTS / "showcase.json").write_text(json.dumps({"meta": meta, "plans": rows}, indent=1) + "\n")
    ours = rows[0]
    lines = [
        "# Showcase: a memory-bound 2-stage pipeline, cuts and recompute chosen together",
        "",
        f"`python bench/bench_showcase.py`: GPT-2 shape {CONFIG}, micro-batch {ROWS}×{SEQ}, {MICRO} micro-batches, "
        f"1F1B, per-rank limit {format_bytes(limit)}; each plan trained {STEPS} steps by the same train.py under "
        f"torchrun in one run (first {WARMUP} skipped); load average at the end {meta['load_average_end']:.1f}.",
        "",
        "| method | cuts | recompute per stage (ms added per micro-batch) | step measured (IQR) | step predicted | "
        "vs autopipe (measured) | peak per rank measured | predicted |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        ratio = r["measured_step_s"] / ours["measured_step_s"]
        lines.append(
            f"| {r['method']} | {r['boundaries']} | "
            f"{' '.join(f'{m} ({x * 1e3:.0f})' for m, x in zip(r['recompute'], r['recompute_s']))} | {r['measured_step_s']:.3f} s "
            f"({r['step_iqr_s']:.3f}) | {r['predicted_step_s']:.3f} s | {ratio:.2f}× | "
            f"{' '.join(format_bytes(m) for m in r['measured_memory'])} | "
            f"{' '.join(format_bytes(m) for m in r['predicted_memory'])} |"
        )
    (RESULTS / "showcase.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
