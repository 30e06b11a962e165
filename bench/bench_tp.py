"""Tensor parallelism on this CPU: the tp 2 plan's predictions against its job, beside tp 1's, and the
collective term alone.

    python bench/bench_tp.py            # writes bench/results/tp.md and tp.json

1. A Llama-shaped model (bench_accuracy's "llama": 6 layers, hidden 256, 4 heads, 2 KV heads, vocab 4096;
   4 x 128 tokens per micro-batch, 4 micro-batches, 1 stage) is converted at tp 1, at tp 2 and at tp 2
   with sequence parallelism (``autopipe convert --tp [--sequence-parallel]``: the cut solved on
   ``autopipe.costs.tp.at_tp``, the profile one tp rank sees, each layer's compute timed at the degree by
   ``autopipe.runtime.checks.tp_timing``) and trained by its train.py under torchrun (1 and 2 processes, gloo, one thread each). The
   whole step (median after warm-up, min-max beside it) and each rank's peak memory (a second run
   under ``--exact-memory``) are set against plan.json's ``total_step_time`` and ``rank_memory``.
2. The collective tp adds: a gloo all-reduce of each size the tp 2 profile's layers all-reduce
   (b·s·h·4 bytes), median of 30 on the same two processes, against ``ring_all_reduce`` at the
   bandwidth and latency the plan priced it with (the profile's host's measured gloo figures,
   DeviceInfo.links: autopipe/runtime/checks/links.py).
3. Per term: each job once more under torch.profiler (steps 5-7, bench/_tp_phases/sitecustomize.py;
   the runtime carries no timing code): per step its wall seconds, its collectives' seconds (gloo's
   ops and the waits on them) and its aten op calls, against the plan's compute and collective
   terms (costs.tp.tp_terms). And DTensor's dispatch alone: one small op on plain tensors and on
   DTensors (2 gloo processes, a 1-D mesh), the difference per op (DTENSOR below).
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


DTENSOR = r'''
import json, statistics, time
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
dist.init_process_group("gloo"); torch.set_num_threads(1)
mesh = init_device_mesh("cpu", (2,))
x = torch.randn(4, 128, 256); h = x[..., :128].contiguous(); w = torch.randn(256, 256)
dx = DTensor.from_local(x, mesh, [Replicate()]); dh = DTensor.from_local(h, mesh, [Shard(2)])
dw = distribute_tensor(w, mesh, [Shard(1)]); wl = w[:, :128].contiguous()
ops = {"add (replicated)": (lambda: x + x, lambda: dx + dx), "mul (sharded)": (lambda: h * h, lambda: dh * dh),
       "silu (sharded)": (lambda: torch.nn.functional.silu(h), lambda: torch.nn.functional.silu(dh)),
       "view": (lambda: x.view(4, 128, 4, 64), lambda: dx.view(4, 128, 4, 64)),
       "transpose": (lambda: x.transpose(1, 2), lambda: dx.transpose(1, 2)),
       "matmul (colwise)": (lambda: x @ wl, lambda: dx @ dw)}
out = {}
for name, fns in ops.items():
    for fn in fns:
        for _ in range(20): fn()
    med = []
    for fn in fns:
        ts = []
        for _ in range(200):
            t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
        med.append(statistics.median(ts))
    out[name] = med
if dist.get_rank() == 0:
    print("RESULT " + json.dumps(out))
dist.destroy_process_group()
'''
COLLECTIVE_OPS = ("c10d", "gloo", "wait_tensor", "all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter")


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}


def convert(folder: Path, tp: int, out: Path, sp: bool = False) -> dict:
    cmd = [sys.executable, "-m", "autopipe", "convert", str(folder), "--stages", "1", "--tp", str(tp), "--batch-size",
           str(ROWS), "--seq-len", str(SEQ), "--microbatches", str(MICRO), "--schedule", "1f1b", "--out", str(out), "--force",
           *(["--sequence-parallel"] if sp else [])]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=1200)
    if done.returncode:
        raise RuntimeError(f"convert --tp {tp} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads((out / "plan.json").read_text())


def train(job: Path, tp: int, *, exact_memory: bool = False, phases: Path | None = None) -> list[dict]:
    log = job / ("memory.json" if exact_memory else "log.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", str(job / "train.py"),
           "--steps", str(12 if exact_memory else STEPS), "--log-json", str(log), *(["--exact-memory"] if exact_memory else [])]
    env = _env()
    if phases is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "_tp_phases"), env.get("PYTHONPATH", "")])
        env["AUTOPIPE_TP_PHASES"] = str(phases)
    done = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"train tp {tp} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    from autopipe.report.steplog import read_step_log

    return read_step_log(log)


def _two(script: str, *args: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(script)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", f.name,
                           *args], env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    line = next(l for l in done.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[7:])


def allreduce(sizes: list[int]) -> dict[int, list[float]]:
    return {int(k): v for k, v in _two(ALLREDUCE, json.dumps(sizes)).items()}


def phases(prefix: Path, ranks: int) -> dict:
    """Per step, the slowest rank's profiled wall seconds, collective seconds and aten op calls."""
    per = []
    for r in range(ranks):
        d = json.loads(Path(f"{prefix}{r}.json").read_text())
        n = len(d["walls"])
        coll = sum(self_s for key, _c, self_s, _t in d["ops"] if any(k in key.lower() for k in COLLECTIVE_OPS))
        calls = sum(c for key, c, _s, _t in d["ops"] if key.startswith("aten::"))
        # the collectives issued (gloo's ops; the functional waits on them are not counted again)
        issued = sum(c for key, c, _s, _t in d["ops"] if key.startswith("c10d::"))
        per.append({"wall_s": sum(d["walls"]) / n, "collective_s": coll / n, "aten_calls": calls / n,
                    "collective_calls": issued / n,
                    "top": sorted(([k, c / n, s_ / n] for k, c, s_, _t in d["ops"]), key=lambda x: -x[2])[:12]})
    return max(per, key=lambda p: p["wall_s"])


def _terms(job: Path, tp: int, sp: bool = False) -> dict:
    """The plan's per-step compute and collective seconds (costs.tp.tp_terms at the profile's link)."""
    from autopipe.costs.layer_costs import Profile
    from autopipe.costs.links import link_bandwidth
    from autopipe.costs.tp import tp_terms

    prof = Profile.load(job / "profile.json")
    if tp == 1:
        return {"compute_s": MICRO * sum(l.time for l in prof.layers), "collective_s": 0.0, "collectives": 0}
    terms = tp_terms(prof, tp, sequence_parallel=sp, bandwidth=link_bandwidth(prof, "all_reduce") or 5e9)
    return {"compute_s": MICRO * sum(t.forward_compute + t.backward_compute for t in terms),
            "collective_s": MICRO * sum(t.forward_collective + t.backward_collective for t in terms),
            "collectives": MICRO * sum(t.forward_collectives + t.backward_collectives for t in terms),
            "links": {k: list(v) for k, v in prof.device.links.items()}}


def main() -> None:
    from bench_accuracy import make_folder

    from autopipe.costs.layer_costs import Profile
    from autopipe.costs.links import link_bandwidth, link_latency
    from autopipe.costs.tp import TP_LATENCY, ring_all_reduce

    load = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="autopipe-tp-"))
    folder = make_folder(root, "llama")
    rows = []
    for tp, sp in ((1, False), (2, False), (2, True)):
        job = root / f"tp{tp}{'sp' if sp else ''}"
        plan = convert(folder, tp, job, sp)
        records = train(job, tp)
        tokens = ROWS * SEQ * MICRO
        steps = [tokens / r["tokens_per_s"] for r in records[WARMUP:]]
        memory = train(job, tp, exact_memory=True)
        peaks = [max(r.get("peak_memory") or [0]) for r in memory[4:]]  # every rank's, from the 5th step on
        train(job, tp, phases=job / "phases-")
        predicted = plan["step_time"] + plan.get("step_overhead", 0.0)
        rows.append({"tp": tp, "sequence_parallel": sp, "predicted_step": predicted, "measured_step": statistics.median(steps),
                     "step_range": [min(steps), max(steps)], "predicted_peak": max(plan["rank_memory"]),
                     "measured_peak": max(peaks) if peaks else None, "boundaries": plan["boundaries"],
                     "profiled": phases(job / "phases-", tp), "terms": _terms(job, tp, sp)})
        print(rows[-1], flush=True)
    prof = Profile.load(root / "tp2" / "profile.json")
    sizes = sorted({int(b) for l in prof.layers if l.tp is not None for b in (*l.tp.allreduce_forward,
                                                                                *l.tp.allreduce_backward)})  # fmt: skip
    measured = allreduce(sizes)
    # the link the plan priced tp's collectives at: the profile's host's measured all-reduce (node_tp_view)
    bw, lat = link_bandwidth(prof, "all_reduce") or 5e9, link_latency(prof, "all_reduce", TP_LATENCY)
    coll = [{"bytes": n, "measured": measured[n][0], "range": measured[n][1:], "predicted": ring_all_reduce(n, 2, bw, lat)}
            for n in sizes]  # fmt: skip
    dtensor = _two(DTENSOR)
    after = os.getloadavg()[0]
    RESULTS.joinpath("tp.json").write_text(json.dumps({"load": [load, after], "jobs": rows, "allreduce": coll,
                                                       "dtensor_op_s": dtensor}, indent=1))  # fmt: skip
    lines = ["# Tensor parallelism on this CPU: the tp 2 plan against its job (bench/bench_tp.py)", "",
             f"Llama-shaped (6 layers, hidden 256, 4 heads, 2 KV heads, vocab 4096), {MICRO} micro-batches of {ROWS} x "
             f"{SEQ} tokens, 1 stage, gloo, one thread per process; load {load:.1f} before, {after:.1f} after.", "",
             "| tp | predicted step | measured step (min-max) | measured / predicted | predicted peak | measured peak |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        ratio = r["measured_step"] / r["predicted_step"]
        peak = f"{r['measured_peak'] / 2**20:.0f} MiB" if r["measured_peak"] else "n/a"
        lines.append(f"| {r['tp']}{' SP' if r.get('sequence_parallel') else ''} | {r['predicted_step']:.3f} s | {r['measured_step']:.3f} s ({r['step_range'][0]:.3f}-"
                     f"{r['step_range'][1]:.3f}) | {ratio:.2f} | {r['predicted_peak'] / 2**20:.0f} MiB | {peak} |")
    lines += ["", "Per term, per step (one more run of each under torch.profiler, steps 5-7, the slower rank; the "
              "profiler's own cost is in its wall):", "",
              "| tp | profiled wall | collectives measured (issued) | collectives priced (count) | rest measured (wall − "
              "collectives) | compute priced | aten calls |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in rows:
        p, t = r["profiled"], r["terms"]
        lines.append(f"| {r['tp']}{' SP' if r.get('sequence_parallel') else ''} | {p['wall_s']:.3f} s | {p['collective_s']:.3f} s "
                     f"({p.get('collective_calls', 0):.0f}) | {t['collective_s']:.3f} s "
                     f"({t['collectives']}) | {p['wall_s'] - p['collective_s']:.3f} s | {t['compute_s']:.3f} s | "
                     f"{p['aten_calls']:.0f} |")  # fmt: skip
    lines += ["", "DTensor's dispatch per op (2 processes, a 1-D mesh of 2, median of 200, µs):", "",
              "| op | plain | DTensor | added |", "| --- | ---: | ---: | ---: |"]
    for name, (plain, dt) in dtensor.items():
        lines.append(f"| {name} | {plain * 1e6:.0f} | {dt * 1e6:.0f} | {(dt - plain) * 1e6:.0f} |")
    lines += ["", "The all-reduce tp adds, alone (2 processes, gloo, median of 30):", "",
              "| bytes | predicted | measured (min-max) | measured / predicted |", "| ---: | ---: | ---: | ---: |"]
    for c in coll:
        lines.append(f"| {c['bytes']:,} | {c['predicted'] * 1e3:.3f} ms | {c['measured'] * 1e3:.3f} ms "
                     f"({c['range'][0] * 1e3:.3f}-{c['range'][1] * 1e3:.3f}) | {c['measured'] / c['predicted']:.1f} |")
    RESULTS.joinpath("tp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
