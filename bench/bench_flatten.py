"""Flatten benchmarks (issue 2), recorded to bench/results/flatten.{json,md}.

1. A Llama config of 70B parameters (80 layers, hidden 8192, vocab 128256) built on the meta device:
   flatten wall time and the process's peak resident memory (fresh subprocess, so the peak is this
   job's alone). Goal: under 60 s and 4 GiB on a 2-core machine.
2. The flattened sequence's forward+backward time against the original model's, on one device,
   measured alternately in the same run (medians and their ratio). Goal: within 2%.

Usage: python bench/bench_flatten.py [--repeats 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

_META_70B = r"""
import json, resource, time
t0 = time.perf_counter()
import torch, autopipe
from autopipe.graph.sources import load_model
t1 = time.perf_counter()
spec = load_model("llama-70b", device="meta", batch_size=1, seq_len=2048)
t2 = time.perf_counter()
seq = autopipe.flatten(spec.model, spec.args, spec.kwargs)
t3 = time.perf_counter()
print(json.dumps({
    "params": sum(p.numel() for p in spec.model.parameters()),
    "layers": len(seq), "blocks": sum(i.kind != "glue" for i in seq.infos),
    "import_s": t1 - t0, "build_meta_s": t2 - t1, "flatten_s": t3 - t2,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
"""


def bench_70b() -> dict:
    out = subprocess.run([sys.executable, "-c", _META_70B], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_overhead(repeats: int, threads: int) -> dict:
    import torch

    import autopipe
    from autopipe.graph.sources import load_model

    torch.set_num_threads(threads)
    spec = load_model("gpt2", device="cpu", batch_size=2, seq_len=128, dropout=0.0)
    model, args, kwargs = spec
    seq = autopipe.flatten(model, args, kwargs)

    def step(fn) -> float:
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        fn(*args, **kwargs).loss.backward()
        return time.perf_counter() - t

    for _ in range(3):  # warm-up both paths
        step(model)
        step(seq)
    eager, flat = [], []
    for k in range(repeats):  # alternate (and swap order) so drift hits both alike
        pair = (model, seq) if k % 2 == 0 else (seq, model)
        for fn in pair:
            (eager if fn is model else flat).append(step(fn))
    me, mf = statistics.median(eager), statistics.median(flat)
    return {
        "model": "gpt2 (124M), batch 2 x 128 tokens, fp32, CPU",
        "threads": threads,
        "repeats": repeats,
        "eager_median_s": me,
        "flattened_median_s": mf,
        "ratio_flattened_over_eager": mf / me,
        "eager_samples_s": eager,
        "flattened_samples_s": flat,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    opts = ap.parse_args()
    import torch

    result = {
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "llama_70b_meta": bench_70b(),
        "flatten_overhead": bench_overhead(opts.repeats, opts.threads),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "flatten.json").write_text(json.dumps(result, indent=1) + "\n")
    m, o = result["llama_70b_meta"], result["flatten_overhead"]
    md = f"""# Flatten benchmarks

Recorded {result['date']} on {result['machine']} by `python bench/bench_flatten.py`.

## Llama 70B on the meta device (goal: < 60 s, < 4 GiB)

| parameters | layers (blocks) | build on meta | flatten | peak RSS of the whole process |
| --- | --- | --- | --- | --- |
| {m['params'] / 1e9:.2f} B | {m['layers']} ({m['blocks']}) | {m['build_meta_s']:.1f} s | {m['flatten_s']:.1f} s | {m['peak_rss_bytes'] / 2**30:.2f} GiB |

## Flattened vs original, forward+backward on one device (goal: within 2%)

{o['model']}, {o['threads']} threads, {o['repeats']} alternating runs each.

| eager median | flattened median | ratio |
| --- | --- | --- |
| {o['eager_median_s'] * 1e3:.1f} ms | {o['flattened_median_s'] * 1e3:.1f} ms | {o['ratio_flattened_over_eager']:.3f} |
"""
    (RESULTS / "flatten.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
