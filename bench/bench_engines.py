"""Measure what each training engine adds to a step on this machine; write autopipe/costs/engine_costs.json.

    python bench/bench_engines.py            # measure; writes the table and bench/results/engines.{json,md}
    python bench/bench_engines.py --no-write # print only

Three probes, each on one thread per process as a job's ranks run:

1. P2P on gloo: two processes ping-pong tensors of 4 KiB .. 4 MiB; one way = half the round trip,
   fitted as latency + bytes / bandwidth.
2. The optimizer: a foreach AdamW step over 4 M parameters in 40 tensors; seconds per parameter.
3. Each engine (torch, deepspeed): 2-stage jobs (1F1B, fp32) of a small GPT-2 (4 blocks, n_embd 128,
   vocab 1024, 2x64 tokens per micro-batch) at 2 and 8 micro-batches, at the same cut. Each job's
   measured whole step (median of the steps after warm-up) is set against the plan's simulation of
   that cut with the P2P figures of probe 1 and no engine terms; what is left is fitted, least
   squares, as ``per_op`` x (F and B ops on the simulated critical path) + a per-step constant; the
   constant less the optimizer's share (probe 2) is ``per_step``.

The model is not the one bench_accuracy.py checks the predictions on (a GPT-2 of 6 blocks, n_embd
256), so that check is not a fit to itself. The machine is shared: each job is run ``--rounds``
times interleaved across engines and the medians kept; the load average is recorded.
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
ROWS, SEQ, STEPS, WARMUP = 2, 64, 10, 3
MICROBATCHES = (2, 8)
CONFIG = dict(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
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


def probe_p2p() -> tuple[float, float, list]:
    """(latency s, bandwidth bytes/s, the measured (bytes, one-way s) rows)."""
    import numpy as np
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "p2p.json")
        mp.spawn(_pingpong, args=(os.path.join(tmp, "store"), out), nprocs=2)
        rows = json.loads(Path(out).read_text())
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
        t0 = time.perf_counter()
        opt.step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
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


def run_job(root: Path, folder: Path, prof, engine: str, m: int, boundaries, tag: str) -> list[float]:
    """The job's whole steps (seconds) after warm-up."""
    import autopipe
    from autopipe.job.folder import JobSettings, emit
    from autopipe.report.steplog import read_step_log

    plan = autopipe.partition(prof, 2, microbatches=m, schedule="1f1b", recompute="none", boundaries=boundaries)
    settings = JobSettings(model=str(folder), stages=2, microbatches=m, schedule="1f1b", batch_size=ROWS, seq_len=SEQ,
                           dtype="fp32", engine=engine)  # fmt: skip
    job = emit(root / f"{engine}-m{m}-{tag}", settings=settings, profile=prof, plan=plan, baselines={}).job_dir
    log = job / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(job / "train.py"),
           "--steps", str(STEPS), "--log-json", str(log)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} M={m} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    tokens = ROWS * SEQ * m
    return [tokens / r["tokens_per_s"] for r in read_step_log(log)[WARMUP:]]


def simulated(prof, m: int, boundaries, latency: float, bandwidth: float, per_op: float) -> float:
    """The plan's schedule step for this cut with the P2P figures and ``per_op`` (no per-step terms)."""
    from autopipe.costs.engines import EngineCosts
    from autopipe.planner.cost_model import CostModel
    from autopipe.planner.schedules import simulate

    costs = EngineCosts("probe", "cpu", per_op, latency, bandwidth, 0.0, 0.0, "probe")
    c = CostModel(prof, None, bandwidth, "1f1b", m, engine=costs).costs
    a, b = list(boundaries[:-1]), list(boundaries[1:])
    import numpy as np

    a, b = np.array(a), np.array(b)
    return simulate("1f1b", forward=c.forward(a, b).tolist(), backward=c.backward(a, b).tolist(),
                    comm=c.comm(a, b).tolist(), ranks=2, microbatches=m).step_time  # fmt: skip


def fit_engine(prof, boundaries, measured: dict[int, float], latency: float, bandwidth: float,
               rate: float) -> tuple[float, float, list]:  # fmt: skip
    """(per_op, per_step) from {M: measured whole step}, and the rows used."""
    import numpy as np

    from autopipe.planner.cost_model import CostModel

    params = CostModel(prof, None, None).param_counts
    held = max(sum(params[a:b]) for a, b in zip(boundaries, boundaries[1:]))
    rows, xs, ys = [], [], []
    for m, step in sorted(measured.items()):
        base = simulated(prof, m, boundaries, latency, bandwidth, 0.0)
        ops = (simulated(prof, m, boundaries, latency, bandwidth, 1e-3) - base) / 1e-3  # per_op's multiplier
        xs.append(ops)
        ys.append(step - base - rate * held)
        rows.append({"microbatches": m, "measured": step, "simulated_layers_and_p2p": base, "critical_ops": ops,
                     "optimizer": rate * held})  # fmt: skip
    per_op, per_step = np.polyfit(np.array(xs), np.array(ys), 1)
    return float(per_op), float(per_step), rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default="torch,deepspeed")
    opts = parser.parse_args()
    load0 = os.getloadavg()[0]
    latency, bandwidth, p2p_rows = probe_p2p()
    print(f"p2p: latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
    rate = probe_optimizer()
    print(f"AdamW: {rate * 1e9:.2f} ns/parameter", flush=True)
    engines = opts.engines.split(",")
    runs: dict[str, dict[int, list[float]]] = {e: {m: [] for m in MICROBATCHES} for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = make_model(root)
        prof = profile_model(folder)
        import autopipe

        boundaries = autopipe.partition(prof, 2, microbatches=4, schedule="1f1b", recompute="none").boundaries
        for r in range(opts.rounds):
            for m in MICROBATCHES:
                for e in engines:
                    steps = run_job(root, folder, prof, e, m, boundaries, f"r{r}")
                    runs[e][m].extend(steps)
                    print(f"round {r} {e:<9} M={m}: median {statistics.median(steps):.4f} s", flush=True)
        fitted = {}
        for e in engines:
            measured = {m: statistics.median(v) for m, v in runs[e].items()}
            per_op, per_step, rows = fit_engine(prof, boundaries, measured, latency, bandwidth, rate)
            fitted[e] = {"per_op": per_op, "per_step": per_step, "rows": rows}
            print(f"{e}: per_op {per_op * 1e3:.2f} ms, per_step {per_step * 1e3:.1f} ms", flush=True)
            for row in rows:
                print("   ", {k: round(v, 4) for k, v in row.items()}, flush=True)
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
    (ROOT / "autopipe" / "costs" / "engine_costs.json").write_text(json.dumps(table, indent=1) + "\n")
    RESULTS.mkdir(parents=True, exist_ok=True)
    raw = {"source": where, "p2p": p2p_rows, "latency": latency, "bandwidth": bandwidth, "adamw_rate": rate,
           "boundaries": list(boundaries), "engines": fitted}  # fmt: skip
    (RESULTS / "engines.json").write_text(json.dumps(raw, indent=1) + "\n")
    lines = ["# Engine overheads on this machine", "", f"`python bench/bench_engines.py`; {where}.", "",
             f"P2P on gloo (one thread per process): latency {latency * 1e6:.0f} µs, bandwidth {bandwidth / 1e9:.2f} GB/s "
             f"(one-way, fitted over {', '.join(str(s >> 10) + ' KiB' for s, _ in p2p_rows)}). "
             f"AdamW (foreach, fp32): {rate * 1e9:.2f} ns per parameter.", "",
             "Small GPT-2 (4 blocks, n_embd 128, vocab 1024, 2×64 tokens per micro-batch), 2 stages 1F1B fp32, "
             f"cut {list(boundaries)}: measured whole step (median) against the plan's simulation of the layers and P2P.", "",
             "| engine | M | measured | layers + P2P | ops on the critical path | optimizer | per_op fitted | per_step fitted |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for e, f in fitted.items():
        for row in f["rows"]:
            lines.append(f"| {e} | {row['microbatches']} | {row['measured']:.4f} s | {row['simulated_layers_and_p2p']:.4f} s | "
                         f"{row['critical_ops']:.0f} | {row['optimizer'] * 1e3:.1f} ms | {f['per_op'] * 1e3:.2f} ms | "
                         f"{f['per_step'] * 1e3:.1f} ms |")  # fmt: skip
    (RESULTS / "engines.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
