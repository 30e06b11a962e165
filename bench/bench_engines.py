"""Measure what each training engine adds to a step on this machine; write autopipe/costs/engine_costs.json.

    python bench/bench_engines.py            # measure; writes the table and bench/results/engines.{json,md}
    python bench/bench_engines.py --no-write # print only
    python bench/bench_engines.py --quick --no-write   # one short round: checks that it runs

Run it on a quiet machine (the load average under 1 before it starts): the jobs it times are the
only work the figures may contain. Three probes, each on one thread per process as a job's ranks run:

1. P2P on gloo: two processes ping-pong tensors of 4 KiB .. 4 MiB; one way = half the round trip,
   fitted as latency + bytes / bandwidth; and an all-reduce between them of 256 KiB .. 8 MiB, fitted
   the same way (a tied tensor's gradient, summed over its holders after the schedule).
2. The step's per-parameter work after the schedule: gradient norm, clip and AdamW as a job runs them,
   over 4 M parameters shaped like a transformer's; seconds per parameter.
3. Each engine (torch, deepspeed): 2-stage jobs (1F1B, fp32) of a small GPT-2 (4 blocks, n_embd 192,
   vocab 2048, 4x128 tokens per micro-batch) at 2, 4 and 8 micro-batches, at one cut, ROUNDS rounds
   interleaved, STEPS steps each (the first WARMUP left out). Each step record of the job's step log
   (``--log-json``) splits the step: each rank's seconds in its chunks' forwards, the schedule's
   seconds (slowest rank) and the whole step. The model is profiled PROFILES times (before each of
   the first rounds) and each simulated schedule is the median over those profiles. The fit, in that order:

   - ``compute_scale``: the ranks' forward seconds over the plan's forward terms (the layers alone,
     as profiled): how much slower the layers run inside a job (two ranks sharing the memory bus
     and caches, micro-batches interleaving) than the profiler timed them; one figure per device,
     measured on the torch engine (DeepSpeed's step log has no forward split) and used for both.
     Measured and reported always, adopted only with ``--fit-scale``: 1.22 on this model's small
     layers over-charged bench_peers' Llama by 21% (bench/results/engines.md), so by default the
     table keeps 1 and the in-job overhead goes to per_op, a fixed cost per chunk op;
   - ``per_step`` (torch): the whole step less the schedule, less the optimizer's own arithmetic
     on the rank with the most parameters and the tied gradient's all-reduce;
   - ``per_op``: the least-squares seconds per forward and per backward of a chunk that make the
     plan's simulated schedule (layers x compute_scale, P2P from probe 1) match the measured ones
     at every micro-batch count; for DeepSpeed, whose log has the whole step only, with ``per_step``
     alongside (for each per_op the per_step that fits best).

Wall time on a quiet machine: an earlier version fitted CPU seconds on a loaded machine (load 5-12)
and every fit came out unphysical (bench/results/engines.md's history). The model is none of those
bench_accuracy.py and bench_peers.py check the predictions on (GPT-2s of 6 and 8 blocks, n_embd 256;
Llamas), so those checks are not a fit to itself.
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # this folder's _notes, when imported from elsewhere
from _notes import write_keeping_notes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ROWS, SEQ, STEPS, WARMUP, ROUNDS = 4, 128, 12, 3, 2
MICROBATCHES = (2, 4, 8)
FIT_SCALE = False  # --fit-scale: adopt the measured compute_scale (see fit_engines)
CONFIG = dict(n_layer=4, n_embd=192, n_head=4, vocab_size=2048, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
              attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
SIZES = (4 << 10, 256 << 10, 1 << 20, 4 << 20)
ALLREDUCE_SIZES = (256 << 10, 1 << 20, 4 << 20, 8 << 20)
PROFILES = 3  # profiles of the bench's model, one before each of the first rounds: per_op is fitted to their median


# ---- probe 1: P2P on gloo -------------------------------------------------------------------------
def _collective(rank: int, store: str, out: str, kind: str) -> None:
    """One of the two gloo processes: per size, the median seconds of a one-way send (``p2p``: half
    a ping-pong's round trip) or of an all-reduce (``allreduce``); rank 0 writes the rows."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    sizes, repeats, skip = (SIZES, 30, 5) if kind == "p2p" else (ALLREDUCE_SIZES, 20, 4)
    rows = []
    for size in sizes:
        t = torch.randn(size // 4)
        times = []
        for i in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "allreduce":
                dist.all_reduce(t)
            elif rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            if i >= skip:
                times.append((time.perf_counter() - t0) / (2 if kind == "p2p" else 1))
        rows.append((size, statistics.median(times)))
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _probe(kind: str, repeats: int, pick: Any) -> tuple[float, float, list]:
    """``repeats`` runs of ``_collective``; per size ``pick`` of their medians, fitted as latency +
    bytes / bandwidth: (latency s, bandwidth bytes/s, the (bytes, s) rows)."""
    import numpy as np
    import torch.multiprocessing as mp

    runs = []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, f"{kind}.json")
            mp.spawn(_collective, args=(os.path.join(tmp, "store"), out, kind), nprocs=2)
            runs.append(json.loads(Path(out).read_text()))
    rows = [(size, pick([run[i][1] for run in runs])) for i, (size, _) in enumerate(runs[0])]
    x, y = np.array([r[0] for r in rows], float), np.array([r[1] for r in rows], float)
    slope, latency = np.polyfit(x, y, 1)
    return max(float(latency), 0.0), float(1 / slope), rows


def probe_p2p(repeats: int = 3) -> tuple[float, float, list]:
    """(latency s, bandwidth bytes/s, the measured (bytes, one-way s) rows): per size the least of
    ``repeats`` probes' medians (a wake-up on a shared machine waits for a core; the link does not)."""
    return _probe("p2p", repeats, min)


def probe_allreduce(repeats: int = 3) -> tuple[float, float, list]:
    """(latency s, bandwidth bytes/s, the (bytes, s) rows) of an all-reduce between two gloo ranks,
    what a tied tensor's gradient takes after the schedule: per size the median of ``repeats``
    probes' medians (unlike a send, an all-reduce also adds the halves, so its bytes cost more)."""
    return _probe("allreduce", repeats, statistics.median)


# ---- probe 2: the optimizer -----------------------------------------------------------------------
def probe_optimizer(params: int = 4_000_000, width: int = 256, device: str = "cpu", kind: str = "job") -> float:
    """CPU seconds per parameter of a step's work after the schedule that grows with the parameters:
    the whole-gradient norm, the clip and the AdamW step, each as the job runs it (autopipe's
    ``global_grad_norm`` sum, ``clip_grads_``, AdamW with ``optimizer_options``' settings), over a
    transformer's mix of tensors (width x 4 width matrices and width-long vectors).

    Why all three and the job's settings: the earlier probe timed torch's default AdamW alone over 40
    equal tensors (2.99 ns per parameter); a job's AdamW (foreach, weight decay) on a GPT-2's or a
    Llama's own parameters took 3.25 and 3.86 ns, and the norm and clip another 0.83 and 1.30 ns,
    which no term of the plan charged (a fixed per_step fitted on a small model took a little). Jobs
    on a CPU step AdamW fused since issue 24 (``optimizer_options``), which the probe follows.

    ``device="cuda"`` times the same work on a GPU in wall seconds between synchronisations (the
    host's CPU time says nothing there); ``kind`` is ``job`` (what ``optimizer_options`` picks),
    ``fused`` or ``foreach``, so the two kernels can be set side by side on one device."""
    import torch

    from autopipe.runtime.training.grads import _sum_of_squares, clip_grads_
    from autopipe.runtime.training.optim import TrainConfig, optimizer_options

    on_gpu = torch.device(device).type == "cuda"
    if not on_gpu:
        torch.set_num_threads(1)
    shapes: list[tuple[int, ...]] = []
    while sum(torch.Size(s).numel() for s in shapes) < params:
        shapes += [(width, 4 * width), (4 * width,), (4 * width, width), (width,), (width,), (width,)]
    ps = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
    total = sum(p.numel() for p in ps)
    for p in ps:
        p.grad = torch.randn_like(p)
    matrices = [p for p in ps if p.dim() > 1]
    vectors = [p for p in ps if p.dim() <= 1]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    options = optimizer_options(TrainConfig(steps=1, microbatches=1), device)
    if kind != "job":
        options = {k: v for k, v in options.items() if k not in ("fused", "foreach")} | {kind: True}
    opt = torch.optim.AdamW(groups, **options)
    # CPU seconds on a CPU: what the step costs, not what the shared machine lets it have
    clock = time.perf_counter if on_gpu else time.thread_time
    times = []
    for i in range(12):
        for p in ps:
            p.grad.mul_(0.5)  # written just before, as by the backward (untimed)
        if on_gpu:
            torch.cuda.synchronize(device)
        t0 = clock()
        norm = _sum_of_squares([p.grad for p in ps], torch.device(device)).sqrt()
        clip_grads_(ps, norm, 1.0)
        opt.step()
        if on_gpu:
            torch.cuda.synchronize(device)
        if i >= 2:
            times.append(clock() - t0)
    return statistics.median(times) / total


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
    from autopipe.runtime.checks.reserve import runtime_reserve

    torch.set_num_threads(1)
    spec = load_model(str(folder), device="cpu", batch_size=ROWS, seq_len=SEQ, dropout=0.0)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
    return autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False,
                            reserve=runtime_reserve("cpu", dtype="fp32", config=spec.model.config))  # fmt: skip


def run_job(root: Path, folder: Path, prof, engine: str, m: int, boundaries, tag: str) -> list[dict]:
    """The job's step records after warm-up: whole step (wall), schedule (slowest rank) and, on the
    torch engine, each rank's forward seconds."""
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
    return [{"whole": tokens / r["tokens_per_s"], "schedule": r["step_time"], "forward": r.get("forward_times") or []}
            for r in read_step_log(log)[WARMUP:]]  # fmt: skip


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def fit_engines(profs: list, boundaries, runs: dict[str, dict[int, list[dict]]], rate: float, latency: float,
                bandwidth: float, allreduce: tuple[float, float] = (0.0, 0.0)) -> dict[str, dict]:
    """Each engine's EngineCosts figures (and the fit's rows) from its jobs' step records
    ({engine: {M: [record, ...]}}): see the module docstring for the order of the fit. ``profs``:
    the model's profiles; each simulated schedule is the median over them (one profile's draw
    landed in per_op: four fits in a day gave 0.75-2.45 ms). ``allreduce``: (latency, bandwidth)
    of the tied gradient's all-reduce, charged after the schedule with the optimizer's work."""
    import numpy as np

    import autopipe
    from autopipe.costs.engines import EngineCosts
    from autopipe.planner.cost_model import CostModel

    prof = profs[0]
    alone = {m: autopipe.partition(prof, 2, microbatches=m, schedule="1f1b", recompute="none", boundaries=boundaries,
                                   bandwidth=None) for m in MICROBATCHES}  # fmt: skip
    # after the schedule, beyond per_step: the norm, clip and AdamW on the rank holding the most
    # parameters and the tied gradient's all-reduce (CostModel.after_schedule, as the plan charges them)
    work = EngineCosts("fit", "cpu", per_op=0.0, send_latency=latency, bandwidth=bandwidth, per_step=0.0,
                       optimizer_rate=rate, source="fit", allreduce_latency=allreduce[0],
                       allreduce_bandwidth=allreduce[1] or None)  # fmt: skip
    after = CostModel(prof, None, None, engine=work).after_schedule(list(boundaries), [0, 1], 2)
    # the layers in a job over the layers alone, per rank and step (torch's log splits the forward)
    ratios = [f / (m * p) for m, recs in runs.get("torch", {}).items() for r in recs
              for f, p in zip(r["forward"], alone[m].stage_forward) if p > 0]  # fmt: skip
    measured_scale = _median(ratios) if ratios else 1.0
    # the scale is a figure of this small model's layers: on the bench_peers models it over-charged a
    # Llama by 21% (bench/results/engines.md), so by default the fit leaves it at 1 and lets per_op,
    # a fixed cost per chunk op whatever the layers' size, take the in-job overhead
    scale = measured_scale if FIT_SCALE else 1.0

    def simulated(m: int, per_op: float) -> float:
        costs = EngineCosts("fit", "cpu", per_op=per_op, send_latency=latency, bandwidth=bandwidth, per_step=0.0,
                            optimizer_rate=0.0, source="fit", compute_scale=scale)  # fmt: skip
        return statistics.median(
            autopipe.partition(p, 2, microbatches=m, schedule="1f1b", recompute="none", boundaries=boundaries,
                               bandwidth=bandwidth, engine=costs).step_time for p in profs)  # fmt: skip

    grid = np.linspace(0.0, 0.030, 601)  # per_op in 50 µs steps up to 30 ms
    out = {}
    for engine, by_m in runs.items():
        ms = sorted(by_m)
        whole = {m: _median([r["whole"] for r in by_m[m]]) for m in ms}
        sched = {m: _median([r["schedule"] for r in by_m[m]]) for m in ms}
        sims = {m: np.array([simulated(m, x) for x in grid]) for m in ms}
        if engine == "torch":  # the log splits the step: the schedule alone fits per_op
            per_step = max(0.0, _median([whole[m] - sched[m] for m in ms]) - after)
            err = sum((sims[m] / sched[m] - 1) ** 2 for m in ms)
            per_op = float(grid[int(np.argmin(err))])
        else:  # the whole step only: per_op and, for each, the per_step that fits best
            best = (float("inf"), 0.0, 0.0)
            for i, x in enumerate(grid):
                rest = [whole[m] - sims[m][i] - after for m in ms]
                ps = max(0.0, sum(rest) / len(rest))
                e = sum(((sims[m][i] + ps + after) / whole[m] - 1) ** 2 for m in ms)
                best = min(best, (e, float(x), ps))
            _, per_op, per_step = best
        i = int(np.argmin(np.abs(grid - per_op)))
        rows = [{"microbatches": m, "whole": whole[m], "schedule": sched[m], "steps": len(by_m[m]),
                 "predicted_schedule": float(sims[m][i]), "predicted_whole": float(sims[m][i]) + per_step + after}
                for m in ms]  # fmt: skip
        out[engine] = {"per_op": float(per_op), "per_step": float(per_step), "compute_scale": scale, "rows": rows,
                       "after_work": after,
                       "measured_scale": measured_scale,
                       "forward_ratios": [min(ratios), max(ratios)] if ratios else []}  # fmt: skip
    return out


def main() -> None:
    global STEPS, ROUNDS, MICROBATCHES, FIT_SCALE
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--engines", default="torch,deepspeed")
    parser.add_argument("--quick", action="store_true", help="one round of 6 steps at 2 and 8 micro-batches: checks it runs")
    parser.add_argument("--fit-scale", action="store_true",
                        help="adopt compute_scale as measured on this bench's model (default: 1, per_op fitted)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="interleaved rounds (more: a steadier median)")
    opts = parser.parse_args()
    ROUNDS = opts.rounds
    FIT_SCALE = opts.fit_scale
    if opts.quick:
        STEPS, ROUNDS, MICROBATCHES = 6, 1, (2, 8)
    load0 = os.getloadavg()[0]
    latency, bandwidth, p2p_rows = probe_p2p()
    print(f"p2p: latency {latency * 1e6:.0f} us, bandwidth {bandwidth / 1e9:.2f} GB/s", flush=True)
    ar_latency, ar_bandwidth, ar_rows = probe_allreduce()
    print(f"all-reduce: latency {ar_latency * 1e6:.0f} us, bandwidth {ar_bandwidth / 1e9:.2f} GB/s "
          f"({', '.join(f'{b >> 20 or b / 2**20:g} MiB {t * 1e3:.2f} ms' for b, t in ar_rows)})", flush=True)
    rate = probe_optimizer()
    print(f"norm + clip + AdamW: {rate * 1e9:.2f} ns/parameter (CPU time)", flush=True)
    engines = opts.engines.split(",")
    if "deepspeed" in engines and "torch" not in engines:
        engines = ["torch", *engines]  # DeepSpeed's fit takes torch's compute_scale
    loads: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = make_model(root)
        profs = [profile_model(folder)]
        import autopipe

        boundaries = autopipe.partition(profs[0], 2, microbatches=4, schedule="1f1b", recompute="none").boundaries
        runs: dict[str, dict[int, list[dict]]] = {e: {m: [] for m in MICROBATCHES} for e in engines}
        for rnd in range(ROUNDS):  # interleaved, so a drift in the machine's load hits every run alike
            if 0 < rnd < PROFILES:
                profs.append(profile_model(folder))
            for m in MICROBATCHES:
                for e in engines:
                    recs = run_job(root, folder, profs[0], e, m, boundaries, f"r{rnd}")
                    runs[e][m] += recs
                    loads.append(os.getloadavg()[0])
                    print(f"round {rnd + 1}/{ROUNDS} {e:<9} M={m}: whole {_median([r['whole'] for r in recs]):.4f} s, "
                          f"schedule {_median([r['schedule'] for r in recs]):.4f} s, load {loads[-1]:.1f}", flush=True)  # fmt: skip
        fitted = fit_engines(profs, boundaries, runs, rate, latency, bandwidth, (ar_latency, ar_bandwidth))
        # the host the figures are seconds of: a plan on another CPU scales the per-call terms by its own probe
        probe = _median([p.device.host_probe for p in profs])
    print(f"host probe: {probe * 1e3:.2f} ms (median of {len(profs)} profiles)", flush=True)
    for e, f in fitted.items():
        print(f"{e}: compute_scale {f['compute_scale']:.3f}, per_op {f['per_op'] * 1e3:.2f} ms, "
              f"per_step {f['per_step'] * 1e3:.1f} ms", f["rows"], flush=True)  # fmt: skip
    load1 = os.getloadavg()[0]
    if not opts.no_write:
        write(fitted, latency, bandwidth, rate, p2p_rows, (load0, max(loads or [load1]), load1), boundaries,
              (ar_latency, ar_bandwidth, ar_rows), len(profs), probe)


def write(fitted: dict, latency: float, bandwidth: float, rate: float, p2p_rows: list, load: tuple, boundaries,
          allreduce: tuple[float, float, list], profiles: int, probe: float) -> None:
    day = time.strftime("%Y-%m-%d", time.gmtime())
    where = (f"bench/bench_engines.py, {day}, {os.cpu_count()} CPUs ({platform.machine()}), load {load[0]:.1f} before, "
             f"at most {load[1]:.1f} during")  # fmt: skip
    table = {"devices": {"cpu": {e: {"engine": e, "device": "cpu", "per_op": f["per_op"], "send_latency": latency,
                                     "bandwidth": bandwidth, "per_step": f["per_step"], "optimizer_rate": rate,
                                     "compute_scale": f["compute_scale"], "allreduce_latency": allreduce[0],
                                     "allreduce_bandwidth": allreduce[1], "host_probe": probe, "source": where}
                                 for e, f in fitted.items()}}}  # fmt: skip
    # adopted only when measured on a quiet machine (the jobs' own two ranks make a load of about 2) and
    # when the fit reproduces every measured step within 5 %: else the figures carry other work
    worst = max(abs(r["predicted_whole"] / r["whole"] - 1) for f in fitted.values() for r in f["rows"])
    quiet = load[0] < 1.0 and load[1] < 3.0
    adopted = bool(quiet and worst <= 0.05)
    if adopted:
        (ROOT / "autopipe" / "costs" / "engine_costs.json").write_text(json.dumps(table, indent=1) + "\n")
    else:
        print(f"not adopted (load {load[0]:.1f} before, at most {load[1]:.1f}; worst fit {worst:.1%}); "
              "autopipe/costs/engine_costs.json left as it was", flush=True)  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    raw = {"source": where, "p2p": p2p_rows, "latency": latency, "bandwidth": bandwidth, "adamw_rate": rate,
           "boundaries": list(boundaries), "engines": fitted, "adopted": adopted,
           "allreduce": {"latency": allreduce[0], "bandwidth": allreduce[1], "rows": allreduce[2]}, "profiles": profiles,
           "host_probe": probe}  # fmt: skip
    (RESULTS / "engines.json").write_text(json.dumps(raw, indent=1) + "\n")
    said = "adopted into autopipe/costs/engine_costs.json" if adopted else "NOT adopted"
    lines = ["# Engine overheads on this machine", "", f"`python bench/bench_engines.py`; {where}; {said} "
             f"(the fit's worst whole step {worst:.1%} off).", "",
             f"P2P on gloo (one thread per process): latency {latency * 1e6:.0f} µs, bandwidth {bandwidth / 1e9:.2f} GB/s "
             f"(one-way, the least of 3 probes per size, fitted over {', '.join(str(s >> 10) + ' KiB' for s, _ in p2p_rows)}). "
             f"Gradient norm + clip + AdamW (fused, fp32, as a job runs them): {rate * 1e9:.2f} ns of CPU per parameter. "
             f"All-reduce between the two (a tied gradient after the schedule): {allreduce[0] * 1e6:.0f} µs + bytes at "
             f"{allreduce[1] / 1e9:.2f} GB/s (medians of 3 probes over {', '.join(f'{b / 2**20:g} MiB' for b, _ in allreduce[2])}). "
             f"per_op fitted to the median schedule over {profiles} profiles of the model. Host probe "
             f"(`autopipe.costs.devices.host_probe`, the profiles' median): {probe * 1e3:.2f} ms; a plan on another CPU "
             "scales per_op, per_step and the latencies by its own probe over this one.", "",
             "Small GPT-2 (4 blocks, n_embd 192, vocab 2048, 4×128 tokens per micro-batch), 2 stages 1F1B fp32, "
             f"cut {list(boundaries)}, {ROUNDS} rounds of {STEPS} steps (medians after {WARMUP}): measured against the "
             "plan with the fitted figures.", "",
             "| engine | M | whole step | predicted | schedule | predicted | compute_scale | per_op | per_step |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for e, f in fitted.items():
        for row in f["rows"]:
            lines.append(f"| {e} | {row['microbatches']} | {row['whole']:.4f} s | {row['predicted_whole']:.4f} s | "
                         f"{row['schedule']:.4f} s | {row['predicted_schedule']:.4f} s | {f['compute_scale']:.3f} | "
                         f"{f['per_op'] * 1e3:.2f} ms | {f['per_step'] * 1e3:.1f} ms |")  # fmt: skip
    ratios = next((f["forward_ratios"] for f in fitted.values() if f["forward_ratios"]), [])
    if ratios:
        measured = next(f["measured_scale"] for f in fitted.values())
        lines += ["", f"The ranks' forward seconds per step over the plan's: median {measured:.3f} (range "
                      f"{ratios[0]:.3f}-{ratios[1]:.3f}); "
                      + ("adopted as compute_scale (--fit-scale)." if FIT_SCALE else
                         "not adopted (compute_scale 1; --fit-scale adopts it): per_op takes the in-job overhead.")]  # fmt: skip
    write_keeping_notes(RESULTS / "engines.md", "\n".join(lines))


if __name__ == "__main__":
    main()
