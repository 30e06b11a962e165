"""gloo's collectives on this CPU: latency α and bandwidth β per collective, and how well α + c·B/β holds.

The worker is the one a CPU profile's link probe runs (autopipe/runtime/checks/links.py): 2 processes
under torchrun, one thread each, gloo; each call after a barrier, the slower rank's seconds. Here over
1 KiB - 16 MiB, REPS calls per size, ROUNDS rounds (each a fresh pair of processes); per size the
median and IQR over all rounds' calls, the fit over the medians, and the fit's error per size. The
ep runtime's count exchange (expert_parallel.exchange_counts, 8 experts) is timed as it runs.
4 processes are not measured: on this host's 2 cores (shared with two other agents' work) they would
time the scheduler, not gloo.

    python bench/bench_gloo_links.py     # -> bench/results/gloo-links.{json,md}
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
SIZES = tuple(1 << e for e in range(10, 25, 2))  # 1 KiB, 4 KiB, ..., 16 MiB
REPS, ROUNDS = 30, 3


def main() -> None:
    from autopipe.runtime.checks.links import COUNT, KINDS, PROBE_SIZES, fit_link, host_links, measure_links, ring_factor

    load_before = os.getloadavg()[0]
    rounds = [measure_links(sizes=SIZES, reps=REPS) for _ in range(ROUNDS)]
    load_after = os.getloadavg()[0]
    world = rounds[0]["world"]
    record: dict = {"world": world, "reps": REPS, "rounds": ROUNDS, "load_before": load_before, "load_after": load_after,
                    "kinds": {}}  # fmt: skip
    lines = ["# gloo collectives on this CPU: latency and bandwidth per collective (bench/bench_gloo_links.py)", "",
             f"{world} processes, one thread each, gloo; each call after a barrier, the slower rank's time; "
             f"{ROUNDS} rounds x {REPS} calls per size; load {load_before:.1f} before, {load_after:.1f} after "
             "(2 cores shared by three agents: expect noise).", "",
             "Fit: t = α + c·B/β by least squares on the relative error (c: 1 for all-reduce at 2 ranks, 1/2 for "
             "the others: the costs' ring factors), B the whole tensor's bytes (the all-to-all's send buffer).", ""]  # fmt: skip
    for kind in KINDS:
        calls = {b: [t for r in rounds for t in r["times"][kind][str(b)]] for b in SIZES}
        med = {b: statistics.median(ts) for b, ts in calls.items()}
        alpha, beta = fit_link(med, kind, world)
        # the product's probe sizes alone, fitted on the same calls: what a profile would record
        probe = fit_link({b: med[b] for b in PROBE_SIZES if b in med}, kind, world)
        per_round = [fit_link({b: statistics.median(r["times"][kind][str(b)]) for b in SIZES}, kind, world) for r in rounds]
        rows = []
        for b in SIZES:
            q = statistics.quantiles(calls[b], n=4)
            fit = alpha + ring_factor(kind, world) * b / beta
            rows.append({"bytes": b, "median_s": med[b], "q1_s": q[0], "q3_s": q[2], "fit_s": fit,
                         "fit_over_measured": fit / med[b]})  # fmt: skip
        record["kinds"][kind] = {"alpha_s": alpha, "beta_Bps": beta, "probe_alpha_s": probe[0], "probe_beta_Bps": probe[1],
                                 "rounds_alpha_s": [a for a, _ in per_round], "rounds_beta_Bps": [b for _, b in per_round],
                                 "sizes": rows}  # fmt: skip
        lines += [f"## {kind}: α = {alpha * 1e6:.0f} µs, β = {beta / 1e9:.2f} GB/s "
                  f"(per round: α {', '.join(f'{a * 1e6:.0f}' for a, _ in per_round)} µs; "
                  f"β {', '.join(f'{b / 1e9:.2f}' for _, b in per_round)} GB/s; the probe's 4 sizes: "
                  f"α {probe[0] * 1e6:.0f} µs, β {probe[1] / 1e9:.2f} GB/s)", "",
                  "| bytes | median (µs) | IQR (µs) | fit (µs) | fit / measured |", "|---:|---:|---:|---:|---:|"]  # fmt: skip
        lines += [f"| {r['bytes']:,} | {r['median_s'] * 1e6:.0f} | {r['q1_s'] * 1e6:.0f}-{r['q3_s'] * 1e6:.0f} | "
                  f"{r['fit_s'] * 1e6:.0f} | {r['fit_over_measured']:.2f} |" for r in rows]
        lines.append("")
    counts = [t for r in rounds for t in r["times"][COUNT]]
    q = statistics.quantiles(counts, n=4)
    record["count_exchange"] = {"median_s": statistics.median(counts), "q1_s": q[0], "q3_s": q[2], "calls": len(counts)}
    lines += [f"## the ep runtime's count exchange (exchange_counts, 8 experts): median "
              f"{statistics.median(counts) * 1e6:.0f} µs, IQR {q[0] * 1e6:.0f}-{q[2] * 1e6:.0f} µs over {len(counts)} calls", ""]
    record["host_links"] = {k: list(v) for k, v in host_links().items()}
    lines += ["What a CPU profile on this host records (`host_links()`, the cached probe's figures): "
              + "; ".join(f"{k} α {a * 1e6:.0f} µs" + (f", β {b / 1e9:.2f} GB/s" if b else "")
                          for k, (a, b) in record["host_links"].items()), ""]  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gloo-links.json").write_text(json.dumps(record, indent=1) + "\n")
    (RESULTS / "gloo-links.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
