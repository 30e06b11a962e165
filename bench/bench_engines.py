"""Measure what each training engine adds to a step on this machine; write autopipe/costs/engine_costs.json.

    python bench/bench_engines.py            # measure; writes the table and bench/results/engines.{json,md}
    python bench/bench_engines.py --no-write # print only

Three probes, each on one thread per process as a job's ranks run:

1. P2P on gloo: two processes ping-pong tensors of 4 KiB .. 4 MiB; one way = half the round trip,
   fitted as latency + bytes / bandwidth.
2. The optimizer: a foreach AdamW step over 4 M parameters in 40 tensors; seconds per parameter.
3. Each engine (torch, deepspeed): 2-stage jobs (1F1B, fp32) of a small GPT-2 (4 blocks, n_embd 192,
   vocab 2048, 4x128 tokens per micro-batch) at 2 and 8 micro-batches, at one cut, each run for 4 and
   for 10 steps: the CPU seconds of all the job's processes (getrusage of the waited-for children),
   differenced, are the steps' own. Per step both ranks spend M x the profiled layers + per_op x 4M
   + what follows the schedule (the optimizer over every parameter + per_step per rank): the slope in
   M gives per_op, the rest per_step.

CPU time, not wall time: the machine is shared (2 cores, the load often 5-8), and a rank waiting for
a core loses wall time but not CPU time; the P2P latency is the least of three probes for the same
reason. The wall steps are recorded beside. The model is none of those bench_accuracy.py checks the
predictions on (GPT-2s of 6 and 8 blocks, n_embd 256; a Llama), so that check is not a fit to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
ROWS, SEQ, STEPS, WARMUP, SHORT = 4, 128, 10, 3, 4
MICROBATCHES = (2, 8)
CONFIG = dict(n_layer=4, n_embd=192, n_head=4, vocab_size=2048, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20)


# ---- probe 1: P2P on gloo -------------------------------------------------------------------------
def _pingpong(rank: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    rows = []
    for size in SIZES:
        t = torch.zeros(size // 4)
        times = []
        for i in range(30):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= 5:
                times.append((time.perf_counter() - t0) / 2)
        rows.append((size, statistics.median(times)))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def probe_p2p(repeats: int = 3) -> tuple[float, float, list]:
    """(latency s, bandwidth bytes/s, the measured (bytes, one-way s) rows): per size the least of
    ``repeats`` probes' medians (a wake-up on a shared machine waits for a core; the link does not)."""
    import numpy as np
    import torch.multiprocessing as mp

    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "p2p.json")
            mp.spawn(_pingpong, args=(os.path.join(tmp, "store"), out), nprocs=2)
            runs.append(json.loads(Path(out).read_text()))
    rows = [(size, min(run[i][1] for run in runs)) for i, (size, _) in enumerate(runs[0])]
    x, y = np.array([r[0] for r in rows], float), np.array([r[1] for r in rows], float)
    slope, latency = np.polyfit(x, y, 1)
    return max(float(latency), 0.0), float(1 / slope), rows


# ---- probe 2: the optimizer -----------------------------------------------------------------------
def probe_optimizer(params: int = 4_000_000, tensors: int = 40) -> float:
    import torch

    torch.set_num_threads(1)
    ps = [torch.nn.Parameter(torch.randn(params // tensors)) for _ in range(tensors)]
    for p in ps:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(ps, lr=1e-4)
    times = []
    for i in range(12):
        t0 = time.thread_time()  # CPU seconds: what the step costs, not what the shared machine lets it have
        opt.step()
        if i >= 2:
            times.append(time.thread_time() - t0)
    return statistics.median(times) / params


# ---- probe 3: the engines -------------------------------------------------------------------------
def make_model(root: Path) -> Path:
    import transformers

    folder = root / "gpt2-small-probe"
    transformers.GPT2Config(architectures=["GPT2LMHeadModel"], use_cache=False, **CONFIG).save_pretrained(folder)
    return folder


def profile_model(folder: Path):
    import torch

    import autopipe
    from autopipe.graph.sources import load_model
    from autopipe.runtime.reserve import runtime_reserve

    torch.set_num_threads(1)
    spec = load_model(str(folder), device="cpu", batch_size=ROWS, seq_len=SEQ, dropout=0.0)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
    return autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False,
                            reserve=runtime_reserve("cpu", dtype="fp32", config=spec.model.config))  # fmt: skip


def run_job(root: Path, folder: Path, prof, engine: str, m: int, boundaries, steps: int, tag: str) -> tuple[list[float], float]:
    """(the job's whole steps after warm-up in wall seconds, the CPU seconds all its processes used)."""
    import resource

    import autopipe
    from autopipe.job.folder import JobSettings, emit
    from autopipe.report.steplog import read_step_log

    plan = autopipe.partition(prof, 2, microbatches=m, schedule="1f1b", recompute="none", boundaries=boundaries)
    settings = JobSettings(model=str(folder), stages=2, microbatches=m, schedule="1f1b", batch_size=ROWS, seq_len=SEQ,
                           dtype="fp32", engine=engine)  # fmt: skip
    job = emit(root / f"{engine}-m{m}-s{steps}-{tag}", settings=settings, profile=prof, plan=plan, baselines={}).job_dir
    log = job / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(job / "train.py"),
           "--steps", str(steps), "--log-json", str(log)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # torchrun waited for its ranks: theirs are in it
    if done.returncode != 0:
        raise RuntimeError(f"{engine} M={m} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tokens = ROWS * SEQ * m
    return [tokens / r["tokens_per_s"] for r in read_step_log(log)[WARMUP:]], cpu


def fit_engine(prof, boundaries, cpu_per_step: dict[int, float], rate: float) -> tuple[float, float, list]:
    """(per_op, per_step) from {M: CPU seconds per step of both ranks together}.

    CPU time, not wall: on a shared machine a rank waiting for a core loses wall time, not CPU time.
    Per step both ranks together spend M x (every layer's forward + backward, as profiled) + per_op
    x (2 ops x 2 chunks x M) + after the schedule (each rank's optimizer over its parameters + per_step
    each): linear in M, so two micro-batch counts give per_op (the slope) and per_step (the rest)."""
    from autopipe.planner.cost_model import CostModel

    model = CostModel(prof, None, None)
    n = len(prof.layers)
    layers = float(model.costs.forward(0, n) + model.costs.backward(0, n))
    (m1, c1), (m2, c2) = sorted(cpu_per_step.items())[:1] + sorted(cpu_per_step.items())[-1:]
    slope = (c2 - c1) / (m2 - m1)
    per_op = (slope - layers) / 4  # 2 chunks x (F + B)
    rest = c1 - m1 * slope
    per_step = (rest - rate * sum(model.param_counts)) / 2  # per rank
    rows = [{"microbatches": m, "cpu_per_step": c, "layers_cpu": m * layers} for m, c in sorted(cpu_per_step.items())]
    return float(per_op), float(per_step), rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--engines", default="torch,deepspeed")
    opts = parser.parse_args()
    load0 = os.getloadavg()[0]
    latency, bandwidth, p2p_rows = probe_p2p()
    print(f"p2p: latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
    rate = probe_optimizer()
    print(f"AdamW: {rate * 1e9:.2f} ns/parameter (CPU time)", flush=True)
    engines = opts.engines.split(",")
    fitted = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = make_model(root)
        prof = profile_model(folder)
        import autopipe

        boundaries = autopipe.partition(prof, 2, microbatches=4, schedule="1f1b", recompute="none").boundaries
        cpu: dict[str, dict[int, float]] = {e: {} for e in engines}
        wall: dict[str, dict[int, float]] = {e: {} for e in engines}
        for m in MICROBATCHES:
            for e in engines:
                # two step counts: the difference is the steps' own CPU time, without start-up and warm-up
                short, c_short = run_job(root, folder, prof, e, m, boundaries, SHORT, "a")
                long, c_long = run_job(root, folder, prof, e, m, boundaries, STEPS, "b")
                cpu[e][m] = (c_long - c_short) / (STEPS - SHORT)
                wall[e][m] = statistics.median(long)
                print(f"{e:<9} M={m}: {cpu[e][m]:.4f} CPU s per step (both ranks), wall median {wall[e][m]:.4f} s, "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        for e in engines:
            per_op, per_step, rows = fit_engine(prof, boundaries, cpu[e], rate)
            for row in rows:
                row["wall_median"] = wall[e][row["microbatches"]]
            fitted[e] = {"per_op": per_op, "per_step": per_step, "rows": rows}
            print(f"{e}: per_op {per_op * 1e3:.2f} ms, per_step {per_step * 1e3:.1f} ms", rows, flush=True)
    load1 = os.getloadavg()[0]
    if not opts.no_write:
        write(fitted, latency, bandwidth, rate, p2p_rows, (load0, load1), boundaries)


def write(fitted: dict, latency: float, bandwidth: float, rate: float, p2p_rows: list, load: tuple, boundaries) -> None:
    day = time.strftime("%Y-%m-%d", time.gmtime())
    where = f"bench/bench_engines.py, {day}, {os.cpu_count()} CPUs ({platform.machine()}), load {load[0]:.1f}-{load[1]:.1f}"
    table = {"devices": {"cpu": {e: {"engine": e, "device": "cpu", "per_op": max(f["per_op"], 0.0),
                                     "send_latency": latency, "bandwidth": bandwidth,
                                     "per_step": max(f["per_step"], 0.0), "optimizer_rate": rate, "source": where}
                                 for e, f in fitted.items()}}}  # fmt: skip
    # a negative figure is no engine's: the layers were profiled slower than the jobs ran them (a
    # loaded machine), so nothing is adopted; the results below still record what was measured
    physical = all(f["per_op"] >= 0 and f["per_step"] >= 0 for f in fitted.values())
    if physical:
        (ROOT / "autopipe" / "costs" / "engine_costs.json").write_text(json.dumps(table, indent=1) + "\n")
    else:
        print("not adopted: a fitted figure is negative; autopipe/costs/engine_costs.json left as it was", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    raw = {"source": where, "p2p": p2p_rows, "latency": latency, "bandwidth": bandwidth, "adamw_rate": rate,
           "boundaries": list(boundaries), "engines": fitted}  # fmt: skip
    (RESULTS / "engines.json").write_text(json.dumps(raw, indent=1) + "\n")
    adopted = "adopted into autopipe/costs/engine_costs.json" if physical else "NOT adopted (a fitted figure is negative)"
    lines = ["# Engine overheads on this machine", "", f"`python bench/bench_engines.py`; {where}; {adopted}.", "",
             f"P2P on gloo (one thread per process): latency {latency * 1e6:.0f} µs, bandwidth {bandwidth / 1e9:.2f} GB/s "
             f"(one-way, the least of 3 probes per size, fitted over {', '.join(str(s >> 10) + ' KiB' for s, _ in p2p_rows)}). "
             f"AdamW (foreach, fp32): {rate * 1e9:.2f} ns of CPU per parameter.", "",
             "Small GPT-2 (4 blocks, n_embd 192, vocab 2048, 4×128 tokens per micro-batch), 2 stages 1F1B fp32, "
             f"cut {list(boundaries)}: CPU seconds per step of both ranks together (runs of {STEPS} and {SHORT} steps, "
             "differenced) against the profile's layers; the rest, linear in M, is the engine's.", "",
             "| engine | M | CPU per step (both ranks) | layers (profiled) | wall step (median) | per_op fitted | per_step fitted |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for e, f in fitted.items():
        for row in f["rows"]:
            lines.append(f"| {e} | {row['microbatches']} | {row['cpu_per_step']:.4f} s | {row['layers_cpu']:.4f} s | "
                         f"{row['wall_median']:.4f} s | {f['per_op'] * 1e3:.2f} ms | {f['per_step'] * 1e3:.1f} ms |")  # fmt: skip
    (RESULTS / "engines.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
