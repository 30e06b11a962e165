"""Routing skew on this CPU: what the profile measures, how it moves the ep plan, what the ep 1 step shows.

    python bench/bench_moe_skew.py          # writes bench/results/moe-skew.md and moe-skew.json

Two tiny Mixtrals of the same shape (tests/moe_skew_models.py: 6 layers, hidden 64, 8 experts, top 2,
4 x 32 tokens per micro-batch): ``mixtral_balanced`` as initialised, and ``mixtral_skewed`` whose
routers in layers 0 and 1 lean on the mean direction of their inputs, so experts 0 and 1 take most
slots (a trained-looking router). Each is

1. profiled (``autopipe.profile``, the layers measured) with its routing counted over 8 micro-batches
   (``autopipe.costs.moe_shape``): per MoE layer the busiest expert's share p50/p95 and each expert's
   mean share;
2. planned at ep 4 over 4 replicas, 2 stages, 4 micro-batches (``cluster.evaluate.node_ep_view``, the
   CPU's default link) priced at the measured p95 skew and as if balanced: the cuts and predicted steps;
3. trained at ep 1 as the untouched model (forward + backward + AdamW, 30 steps after 5 of warm-up,
   one thread, the two models' steps alternated): is the skew visible in measured CPU time when every
   rank holds every expert?

The ep > 1 jobs need the ep runtime (``convert --ep``/``train.py``), another branch's: this script runs
them when ``autopipe convert --help`` lists ``--ep`` and records that it could not otherwise.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "bench" / "results"
EP, DP, STAGES, MICRO, BATCHES, STEPS, WARMUP = 4, 4, 2, 4, 8, 30, 5


def _profile(name: str) -> tuple:
    import autopipe
    import moe_skew_models as M
    from autopipe.costs.moe_shape import moe_shapes, with_moe_shapes
    from autopipe.graph.sources import load_model

    ms = load_model(f"tests/moe_skew_models.py:{name}", device="cpu")
    seq = autopipe.flatten(ms.model, ms.args, ms.kwargs)
    prof = autopipe.profile(seq, ms.args, ms.kwargs, progress=False, tp_shapes=False, threads=1)
    t = time.perf_counter()
    shapes = moe_shapes(ms.model, seq, [(ms.args, ms.kwargs), *M.batches(BATCHES - 1)])
    return ms, with_moe_shapes(prof, shapes), time.perf_counter() - t


def _plans(prof) -> dict:
    from autopipe.cluster.evaluate import node_ep_view
    from autopipe.costs.ep import ep_terms
    from autopipe.planner.partitioner import partition

    out = {}
    for skew in ("balanced", "p95"):
        view = node_ep_view(prof, EP, gpus=STAGES * DP, dp=DP, skew=skew)
        plan = partition(view, STAGES, microbatches=MICRO, dp=DP)
        terms = ep_terms(prof, EP, bandwidth=5e9, skew=skew)
        out[skew] = {"boundaries": list(plan.boundaries), "predicted_step": plan.predicted_step,
                     "stage_times": [s for s in plan.stage_times] if hasattr(plan, "stage_times") else [],
                     "skew_seconds_per_microbatch": {t.name: t.skew_seconds for t in terms},
                     "busiest_rank_share": {t.name: t.share for t in terms}}
    return out


def _eager_steps(models: dict) -> dict[str, list[float]]:
    """Each untouched model trained at ep 1 (every expert on this one process): seconds per step, the
    models' steps alternated so a shared host's load falls on both alike."""
    import torch

    torch.set_num_threads(1)
    opts = {}
    for name, ms in models.items():
        ms.model.train()
        opts[name] = torch.optim.AdamW(ms.model.parameters(), lr=1e-4)
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(STEPS + WARMUP):
        for name, ms in models.items():
            t = time.perf_counter()
            for _ in range(MICRO):
                ms.model(*ms.args, **ms.kwargs).loss.backward()
            opts[name].step()
            opts[name].zero_grad()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - t)
    return times


def _ep_runtime() -> bool:
    help_text = subprocess.run([sys.executable, "-m", "autopipe", "convert", "--help"], capture_output=True, text=True,
                               env={**os.environ, "COLUMNS": "250"}).stdout  # fmt: skip
    return "--ep" in help_text


def main() -> None:
    record: dict = {"load_before": os.getloadavg()[0], "cpus": os.cpu_count(), "models": {}}
    loaded = {}
    for name in ("mixtral_balanced", "mixtral_skewed"):
        ms, prof, count_s = _profile(name)
        loaded[name] = ms
        layers = {}
        for l in prof.layers:
            if l.moe is None:
                continue
            layers[l.name] = {"busiest_p50": l.moe.busiest(0.5), "busiest_p95": l.moe.busiest(0.95),
                              "shares": list(l.moe.shares()), "forward_ms": l.forward_time * 1e3,
                              "backward_ms": l.backward_time * 1e3, "source": l.source}
        record["models"][name] = {"count_seconds": count_s, "layers": layers, "plans_ep4": _plans(prof),
                                  "profile_host_load": prof.host_load}
    for name, steps in _eager_steps(loaded).items():
        q = statistics.quantiles(steps, n=4)
        record["models"][name]["ep1_step"] = {"median": statistics.median(steps), "q1": q[0], "q3": q[2],
                                              "min": min(steps), "max": max(steps)}
    record["load_after"] = os.getloadavg()[0]
    record["ep_runtime"] = _ep_runtime()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe-skew.json").write_text(json.dumps(record, indent=1))
    from _notes import write_keeping_notes

    write_keeping_notes(RESULTS / "moe-skew.md", _markdown(record))


def _markdown(r: dict) -> str:
    lines = ["# Routing skew: measured, planned at ep 4, and the ep 1 step", "",
             f"Host: {r['cpus']} CPUs, load {r['load_before']:.1f} before, {r['load_after']:.1f} after (shared).",
             f"tests/moe_skew_models.py, {BATCHES} micro-batches counted; plans: ep {EP}, dp {DP}, {STAGES} stages, "
             f"{MICRO} micro-batches, the CPU's default link.", ""]
    for name, m in r["models"].items():
        lines += [f"### {name}", "", "| layer | busiest expert p50 | p95 | mean share per expert |", "|---|---|---|---|"]
        for layer, d in m["layers"].items():
            shares = " ".join(f"{s:.2f}" for s in d["shares"])
            lines.append(f"| {layer} | {d['busiest_p50']:.3f} | {d['busiest_p95']:.3f} | {shares} |")
        lines += ["", f"Profile (host load {m['profile_host_load']:.1f}): each MoE layer "
                  f"{next(iter(m['layers'].values()))['forward_ms']:.2f} ms forward, "
                  f"{next(iter(m['layers'].values()))['backward_ms']:.2f} ms backward per micro-batch "
                  "(identical layers measured once).", "",
                  "| pricing | cut | predicted step (ms) |", "|---|---|---|"]
        for skew, p in m["plans_ep4"].items():
            lines.append(f"| {skew} | {p['boundaries']} | {p['predicted_step'] * 1e3:.2f} |")
        s = m["ep1_step"]
        lines += ["", f"ep 1 step (untouched model, {MICRO} micro-batches + AdamW, 1 thread): median "
                      f"{s['median'] * 1e3:.2f} ms, IQR {s['q1'] * 1e3:.2f}-{s['q3'] * 1e3:.2f}, "
                      f"min-max {s['min'] * 1e3:.2f}-{s['max'] * 1e3:.2f}; counting the routing took "
                      f"{m['count_seconds']:.2f} s.", ""]
    lines.append("ep > 1 jobs: " + ("measured by `bench/bench_moe_ep_step.py` (ep 2, 2 processes): "
                                    "`bench/results/moe-ep-step.md`." if r["ep_runtime"] else
                                    "not run: `convert --ep` is not on this branch (the ep runtime is another's)."))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
