"""The cluster search measured: a GPT-2-shaped model on this machine's CPU, 4 processes (gloo).

    python bench/bench_search_cpu.py            # writes bench/results/search_cpu.{json,md}

The model (8 blocks, width 256, vocabulary 8192, 64 tokens) is profiled here with one thread per
process, at one sample per micro-batch; the search plans 4 devices of one node (the CPU's stated
links, autopipe/cluster/topology.py) for a global batch of 8 under a per-rank memory limit; then the chosen
layout and the runners-up are each trained with the generated train.py under torchrun
(--nproc-per-node 4, --dp as the layout has it; train.py runs the layout's ZeRO stage, written from
its plan), one after another in this same run, and the median step after warm-up is set beside the
predicted step. Every ZeRO stage is searched (the runtime runs 0-3 since issue 12).
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
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
CONFIG = {"n_layer": 8, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 128}
SEQ, GLOBAL_BATCH, GPUS, LIMIT, STEPS, WARMUP, RUNS = 64, 8, 4, "200MiB", 9, 3, 4


def make_folder(root: Path) -> Path:
    from transformers import GPT2Config

    folder = root / "model"
    GPT2Config(architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
               bos_token_id=0, eos_token_id=0, use_cache=False, **CONFIG).save_pretrained(folder)
    return folder


def profile_model(folder: Path):  # noqa: ANN201
    import torch

    import autopipe
    from autopipe.graph.sources import load_model
    from autopipe.runtime.checks.reserve import runtime_reserve

    torch.set_num_threads(1)  # as each rank runs
    spec = load_model(str(folder), device="cpu", batch_size=1, seq_len=SEQ, dropout=0.0)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
    return autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False, reserve=runtime_reserve("cpu"))


def train(job: Path, folder: Path, prof, layout, plan, name: str) -> tuple[list[float], float]:  # noqa: ANN001
    from autopipe.costs.rescale import scale_microbatch
    from autopipe.job.folder import JobSettings, emit
    from autopipe.report.steplog import read_step_log

    settings = JobSettings(model=str(folder), stages=plan.stages, microbatches=plan.microbatches,
                           schedule=plan.schedule, batch_size=layout.microbatch_size, seq_len=SEQ)  # fmt: skip
    run = emit(job / name, settings=settings, profile=scale_microbatch(prof, layout.microbatch_size), plan=plan,
               baselines={}).job_dir  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={GPUS}",
           str(run / "train.py"), "--dp", str(layout.dp), "--steps", str(STEPS), "--log-json", str(run / "log.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    records = [r for r in read_step_log(run / "log.json") if "step_time" in r]
    by_step: dict[int, float] = {}
    for r in records:  # every rank logs; a step lasts as long as its slowest rank says
        by_step[r.get("step", len(by_step))] = max(by_step.get(r.get("step", len(by_step)), 0.0), r["step_time"])
    peaks = [max(r["peak_memory"]) for r in records[WARMUP:] if r.get("peak_memory")]  # per-rank lists
    return [t for s, t in sorted(by_step.items())][WARMUP:], float(max(peaks, default=0))


def main() -> None:
    from autopipe.cluster.evaluate import evaluate
    from autopipe.cluster.layout_search import search
    from autopipe.cluster.topology import cluster_for

    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp)
        folder = make_folder(job)
        prof = profile_model(folder)
        cluster = cluster_for("cpu", GPUS, GPUS)
        res = search(prof, cluster, global_batch=GLOBAL_BATCH, memory_limit=LIMIT, top=RUNS)
        rows = []
        for i, x in enumerate(res.layouts[:RUNS]):
            load_before = os.getloadavg()[0]
            done, plan = evaluate(prof, cluster, x, memory_limit=LIMIT)
            assert plan is not None
            times, peak = train(job, folder, prof, x, plan, f"layout{i}")
            med = statistics.median(times)
            rows.append({"rank": i + 1, "layout": x.label, "placement": x.placement, "boundaries": list(plan.boundaries),
                         "recompute": list(plan.stage_recompute), "predicted_step_s": done.step_time,
                         "predicted_pipeline_s": done.pipeline_time, "predicted_reduce_s": done.reduce_time,
                         "predicted_samples_per_s": done.throughput, "predicted_peak_mib": plan.peak_memory / 2**20,
                         "measured_step_s": med, "measured_min_s": min(times), "measured_max_s": max(times),
                         "measured_samples_per_s": GLOBAL_BATCH / med, "steps_timed": len(times),
                         "measured_peak_mib": peak / 2**20,
                         "load_before": load_before, "load_after": os.getloadavg()[0]})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    out = {"config": dict(CONFIG, seq_len=SEQ, global_batch=GLOBAL_BATCH, gpus=GPUS, memory_limit=LIMIT),
           "search": {"considered": res.considered, "pruned_memory": res.pruned_memory,
                      "pruned_bound": res.pruned_bound, "solved": res.solved, "infeasible": res.infeasible,
                      "seconds": res.seconds},
           "runs": rows}  # fmt: skip
    (RESULTS / "search_cpu.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
