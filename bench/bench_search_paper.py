"""The cluster search on paper: Llama 7B, 13B and 70B (H100 estimates) on 8, 64 and 512 H100s,
the searched layout's predicted throughput against the rules of thumb users apply today.

    python bench/bench_search_paper.py          # writes bench/results/search_paper.json, then search.md
    python bench/bench_search_paper.py --md     # search.md again from search_paper.json and search_cpu.json
    python bench/bench_search_paper.py llama-70b  # only these models (the other rows are kept)

Rules of thumb (each at the same GPU count and global batch), as their users set them up:
- the cut: torchtitan splits layers evenly (embedding and head weigh one layer each: baselines
  "torchtitan"); DeepSpeed balances parameter counts ("parameters"); Megatron-LM splits decoder
  layers uniformly with one fewer on the first and the last stage
  (--decoder-first/last-pipeline-num-layers), the embedding and the head on those stages;
- the layout: the fewest pipeline stages (a power of two) under which that cut fits the memory, the
  rest data-parallel; micro-batch size 1 and M = global batch / replicas; 1F1B; activation recompute
  off, or full in every stage when off does not fit; stages outermost (a stage's replicas side by
  side, as Megatron's and torchtitan's meshes and DeepSpeed's topology number them); ZeRO 1 for
  Megatron (distributed optimizer) and DeepSpeed (its pipeline engine's most), ZeRO 2 for
  torchtitan (FSDP2 under a pipeline keeps parameters unsharded through the step).
Every figure is predicted by the same model (autopipe/cluster/layout_search.py's evaluate); nothing here runs on a GPU.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopipe.cluster.evaluate import evaluate
from autopipe.cluster.layout_search import search  # noqa: E402
from autopipe.cluster.layouts import Layout  # noqa: E402
from autopipe.cluster.topology import cluster_for  # noqa: E402
from autopipe.costs.layer_costs import Profile  # noqa: E402
from autopipe.errors import AutopipeError, InfeasibleMemoryError  # noqa: E402

RESULTS = ROOT / "bench" / "results"
MODELS = ("llama-7b", "llama-13b", "llama-70b")
CLUSTERS = ((8, 64), (64, 512), (512, 512))  # (GPUs, global batch in samples of 2048 tokens)
LIMIT = "80GiB"
RULES = {"torchtitan (even layers)": ("torchtitan", 2), "DeepSpeed (parameters)": ("parameters", 1),
         "Megatron (uniform, fewer first/last)": ("megatron", 1)}


def megatron_cut(prof: Profile, stages: int) -> list[int] | None:
    """Decoder layers uniform with one fewer on the first and last stage (which also hold the
    embedding and the norm + head); None where that leaves a stage empty or cannot be uniform."""
    dec = [i for i, l in enumerate(prof.layers) if ".layers." in l.name]
    if stages == 1:
        return [0, len(prof.layers)]
    first, n = dec[0], len(dec)
    q, extra = divmod(n + 2, stages)  # two layers' worth taken from the end stages
    if q < 2:
        return None
    sizes = [q - 1] + [q + (s <= extra) for s in range(1, stages - 1)] + [q - 1]
    sizes[-1] += n - sum(sizes)  # whatever rounding leaves goes to the last stage
    if min(sizes) < 1:
        return None
    bounds, at = [0], first
    for size in sizes[:-1]:
        at += size
        bounds.append(at)
    return bounds + [len(prof.layers)]


def rule_of_thumb(prof: Profile, cluster, batch: int, method: str, zero: int) -> Layout | None:  # noqa: ANN001
    s = 1
    while s <= min(cluster.gpus, len(prof.layers)):
        r = cluster.gpus // s
        if batch % r == 0:
            x = Layout(s, r, 1, batch // r, "1f1b", 1, zero if r > 1 else 0, "replica-inner")
            cut = megatron_cut(prof, s) if method == "megatron" else None
            for recompute in ("none", "full"):
                try:
                    done, _ = evaluate(prof, cluster, x, memory_limit=LIMIT, recompute=recompute,
                                       method="manual" if cut else method if method != "megatron" else "uniform",
                                       boundaries=cut)  # fmt: skip
                except AutopipeError:
                    continue
                if done.fits:
                    return done
        s *= 2
    return None


def load() -> float:
    return os.getloadavg()[0]


def main(models: list[str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "search_paper.json"
    rows = [r for r in (json.loads(path.read_text()) if path.exists() and models else []) if r["model"] not in models]
    for name in models or MODELS:
        prof = Profile.load(ROOT / "profiles" / f"{name}-h100-estimate.json")
        for gpus, batch in CLUSTERS:
            cluster = cluster_for(prof.device.name, gpus)
            repeats = 3 if (name, gpus) == ("llama-70b", 512) else 1
            walls, cpus, res, failed = [], [], None, ""
            for _ in range(repeats):
                w, c = time.perf_counter(), time.process_time()
                try:
                    res = search(prof, cluster, global_batch=batch, memory_limit=LIMIT)
                except InfeasibleMemoryError as e:  # says what would fit, in one line: recorded as such
                    failed = str(e)
                walls.append(time.perf_counter() - w)
                cpus.append(time.process_time() - c)
            if res is None:
                rows.append({"model": name, "gpus": gpus, "global_batch": batch, "load": load(), "walls": walls,
                             "search_wall_s": statistics.median(walls), "search_cpu_s": statistics.median(cpus),
                             "infeasible_message": failed})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
                continue
            row = {"model": name, "gpus": gpus, "global_batch": batch, "load": load(),
                   "search_wall_s": statistics.median(walls), "search_cpu_s": statistics.median(cpus),
                   "walls": walls, "considered": res.considered, "pruned_memory": res.pruned_memory,
                   "pruned_dominated": res.pruned_dominated, "pruned_bound": res.pruned_bound,
                   "solved": res.solved, "infeasible": res.infeasible,
                   "best": {"label": res.best.label, "placement": res.best.placement,
                            "tokens_per_s": res.best.tokens_per_second, "peak_gib": res.best.peak_memory / 2**30,
                            "recompute": sorted(set(res.best.recompute))},
                   "rules": {}}  # fmt: skip
            for rule, (method, zero) in RULES.items():
                x = rule_of_thumb(prof, cluster, batch, method, zero)
                row["rules"][rule] = None if x is None else {
                    "label": x.label, "tokens_per_s": x.tokens_per_second, "peak_gib": x.peak_memory / 2**30,
                    "recompute": sorted(set(x.recompute))}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    (RESULTS / "search_paper.json").write_text(json.dumps(rows, indent=1) + "\n")
    write_md()


def _tok(x: float | None) -> str:
    return "—" if x is None else f"{x / 1e3:,.1f}k"


def write_md() -> None:
    """bench/results/search.md from the paper rows and, when there, the CPU run's."""
    rows = json.loads((RESULTS / "search_paper.json").read_text())
    rows.sort(key=lambda r: (MODELS.index(r["model"]), r["gpus"]))
    lines = ["# Cluster search: chosen layout vs rules of thumb, and measured on CPU", "",
             "## On paper: Llama (H100 estimates, seq 2048, bf16 autocast, AdamW) on H100 clusters, 80 GiB per GPU", "",
             "Predicted tokens/s of the searched layout against each rule of thumb at the same GPU count and global",
             "batch (the rules: `bench/bench_search_paper.py`'s docstring; the same cost model prices all). The ratio",
             "is the search's throughput over the rule's.", "",
             "| model | GPUs | global batch | searched layout (placement) | tok/s | " + " | ".join(RULES) + " |",
             "| --- | ---: | ---: | --- | ---: | " + " | ".join("---" for _ in RULES) + " |"]
    for r in rows:
        if "infeasible_message" in r:
            lines.append(f"| {r['model']} | {r['gpus']} | {r['global_batch']} | nothing fits: `{r['infeasible_message']}` | — | "
                         + " | ".join("does not fit" for _ in RULES) + " |")
            continue
        best = r["best"]
        cells = []
        for rule in RULES:
            x = r["rules"].get(rule)
            if x is None:
                cells.append("does not fit")
                continue
            ratio = best["tokens_per_s"] / x["tokens_per_s"]
            rec = "full recompute" if "full" in x["recompute"] else "no recompute"
            cells.append(f"{_tok(x['tokens_per_s'])} ({x['label'].split(', ')[0]}, {rec}): **{ratio:.2f}×**")
        rec = ", ".join(m for m in best["recompute"] if m != "none") or "no recompute"
        lines.append(f"| {r['model']} | {r['gpus']} | {r['global_batch']} | {best['label']} ({best['placement']}; {rec}; "
                     f"peak {best['peak_gib']:.1f} GiB) | {_tok(best['tokens_per_s'])} | " + " | ".join(cells) + " |")
    lines += ["", "### Search time and counts", "",
              "Wall and CPU seconds of `search()` on this shared 2-core machine (load average at the end of each; the",
              "70B × 512 search is the median of 3 runs), and the layouts considered, refused by the memory bound,",
              "left out as dominated (ZeRO 3 beside 2), pruned by the throughput bound, and solved (of which no cut fit).", "",
              "| model | GPUs | wall s | CPU s | load | considered | memory | dominated | bound | solved (no fit) |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        walls = ", ".join(f"{w:.1f}" for w in r["walls"])
        if "infeasible_message" in r:
            lines.append(f"| {r['model']} | {r['gpus']} | {r['search_wall_s']:.1f} ({walls}) | {r['search_cpu_s']:.1f} | "
                         f"{r['load']:.1f} | nothing fits (message above) | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['gpus']} | {r['search_wall_s']:.1f} ({walls}) | {r['search_cpu_s']:.1f} | "
                     f"{r['load']:.1f} | {r['considered']} | {r['pruned_memory']} | {r['pruned_dominated']} | "
                     f"{r['pruned_bound']} | {r['solved']} ({r['infeasible']}) |")
    cpu = RESULTS / "search_cpu.json"
    if cpu.exists():
        d = json.loads(cpu.read_text())
        c, s = d["config"], d["search"]
        lines += ["", "## Measured: GPT-2-shaped model on this CPU, 4 processes (gloo, 1 thread each)", "",
                  f"Model {{n_layer {c['n_layer']}, n_embd {c['n_embd']}, vocab {c['vocab_size']}}}, {c['seq_len']} tokens, "
                  f"global batch {c['global_batch']}, {c['gpus']} processes on one node, {c['memory_limit']} per rank, every "
                  f"ZeRO stage searched. Search: {s['considered']} layouts, {s['solved']} solved "
                  f"({s['infeasible']} with no cut that fits), {s['seconds']:.1f} s. Each layout was then trained by the "
                  "generated train.py under torchrun in the same run, one after another; the step is the median after "
                  "warm-up (min–max beside it), with the load average before and after.", "",
                  "| # | layout | predicted step (pipeline + DP) | measured step (min–max) | measured / predicted | "
                  "predicted peak | measured peak | load |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for x in d["runs"]:
            lines.append(f"| {x['rank']} | {x['layout']} | {x['predicted_step_s']:.3f} s ({x['predicted_pipeline_s']:.3f} + "
                         f"{x['predicted_step_s'] - x['predicted_pipeline_s']:.3f}) | {x['measured_step_s']:.3f} s "
                         f"({x['measured_min_s']:.3f}–{x['measured_max_s']:.3f}) | "
                         f"{x['measured_step_s'] / x['predicted_step_s']:.2f} | {x['predicted_peak_mib']:.0f} MiB | "
                         f"{x['measured_peak_mib']:.0f} MiB | {x['load_before']:.1f}–{x['load_after']:.1f} |")
    (RESULTS / "search.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    write_md() if "--md" in sys.argv else main(sys.argv[1:])
