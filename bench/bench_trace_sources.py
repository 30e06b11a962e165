"""What recording source lines costs a trace: ``flatten(..., stack_traces=False)`` (the default since
4eccaa8) against ``stack_traces=True`` (what torch.export does by default, and what flatten did before).

Each model is built on the meta device (the runtime's ranks and ``convert`` trace it there), then
flattened alternately without and with source lines, in one process after a warm-up trace of each
(the first trace of a process pays for imports and caches). Medians of the repeats and their
ratio, measured in the same run; the machine's load before and after.

    python bench/bench_trace_sources.py [--repeats 5]   # -> bench/results/trace-sources.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _notes import write_keeping_notes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# (builtin model, sequence length, repeats scale): GPT-2 124M (12 blocks), a Llama-7B (32) and a 70B (80)
MODELS = [("gpt2", 1024, 1.0), ("llama-7b", 2048, 0.6), ("llama-70b", 2048, 0.4)]


def _time(spec, stack_traces: bool) -> float:  # noqa: ANN001
    import autopipe

    t0 = time.perf_counter()
    autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False, stack_traces=stack_traces)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import torch

    from autopipe.graph.sources import load_model

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    rows = []
    for name, seq_len, scale in MODELS:
        spec = load_model(name, device="meta", batch_size=1, seq_len=seq_len)
        _time(spec, False), _time(spec, True)  # warm-up
        lean, full = [], []
        for _ in range(max(2, round(args.repeats * scale))):
            lean.append(_time(spec, False))
            full.append(_time(spec, True))
        rows.append({"model": name, "seq_len": seq_len, "without_s": lean, "with_s": full,
                     "without_median_s": statistics.median(lean), "with_median_s": statistics.median(full)})
        print(f"{name}: without {statistics.median(lean):.2f} s, with {statistics.median(full):.2f} s", flush=True)
    load_after = os.getloadavg()[0]
    record = {"torch": torch.__version__, "load_before": load_before, "load_after": load_after, "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "trace-sources.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [
        "# Source lines in a trace: what they cost (bench/bench_trace_sources.py)",
        "",
        f"flatten on the meta device, one thread, torch {torch.__version__}; without and with source lines "
        f"alternately in one process, after a warm-up of each; load {load_before:.1f} before, {load_after:.1f} after.",
        "",
        "| model | tokens | without (median, min-max) | with (median, min-max) | without / with |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lo, hi = r["without_s"], r["with_s"]
        lines.append(f"| {r['model']} | {r['seq_len']} | {r['without_median_s']:.2f} s ({min(lo):.2f}-{max(lo):.2f}) "
                     f"| {r['with_median_s']:.2f} s ({min(hi):.2f}-{max(hi):.2f}) "
                     f"| {r['without_median_s'] / r['with_median_s']:.2f} |")
    write_keeping_notes(RESULTS / "trace-sources.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
