"""Does the per-layer profile add up to the whole model? GPT-2 124M (or a small GPT-2) on this CPU.

    python bench/bench_profile.py [--seq-len 128] [--repeats 10] [--threads 1]
    python bench/bench_profile.py --small        # 6 blocks x 256, vocabulary 8192, 4 x 128 tokens
    python bench/bench_profile.py --small --cpu-time   # every clock reads this thread's CPU time

``--cpu-time`` is for a shared machine: the time other processes hold the core does not count
(their cache and memory traffic still does). Wall clock is what a quiet machine should be measured in.

Records to bench/results/profile.json and .md (profile-small.* with --small), and saves the measured
GPT-2 124M profile as profiles/gpt2-cpu.json:
- the sum of per-layer forward+backward medians against the whole sequence's forward+backward median,
  timed in the same run (whole-model runs before and after the profile, so drift hits both); the
  unsplit tied model also sums the two gradients of wte/lm_head, so the ratio is given with that
  measured sum added, and for an untied GPT-2 as a control;
- the sum of per-layer activation bytes against the whole sequence's saved-tensor bytes;
- estimate-mode time shares (roofline over the probed CPU) against the measured shares;
- the layers timed alone against the whole model, and the same with the gap the profiler measured
  and charged to the layers (``LayerCost.forward_gap``/``backward_gap``); and why there is a gap:
  the minor page faults of one whole forward+backward against those of every layer's alone, under
  the runtime's allocator settings (``keep_freed_memory``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import autopipe
from autopipe.costs.devices import ALLOCATOR_SETTINGS, keep_freed_memory
from autopipe.costs.measure import static_storage_keys, storage_key, time_layer
from autopipe.files import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent


def whole_model_times(seq, ids, repeats: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Forward+backward seconds of the whole sequence, gradients by autograd.grad (no .grad writes)."""
    params = [p for p in dict.fromkeys(seq.parameters()) if p.requires_grad]
    samples = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        out = seq.pack_inputs((ids,), {})
        for layer in seq.layers:
            out = layer(out)
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
        torch.autograd.grad(outs, params, [torch.ones_like(t) for t in outs], allow_unused=True)
        if i >= 2:  # two warm-up runs
            samples.append(time.perf_counter() - t0)
    return samples


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def page_faults(seq, ids) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """Minor page faults of one whole forward+backward, and of one forward+backward of every layer
    alone (each after a warm-up run): what the whole step maps afresh that a layer alone does not."""
    whole_model_times(seq, ids, 0)
    f0 = _minor_faults()
    whole_model_times(seq, ids, 1)
    whole = _minor_faults() - f0
    inputs = []
    with torch.no_grad():
        x = seq.pack_inputs((ids,), {})
        for layer in seq.layers:
            xs = x if isinstance(x, tuple) else (x,)
            xs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in xs)
            inputs.append(xs if len(xs) > 1 else xs[0])
            x = layer(x)
    alone = 0
    for layer, x in zip(seq.layers, inputs):
        time_layer(layer, x, device=torch.device("cpu"), warmup=1, repeats=1, target_spread=None)
        f0 = _minor_faults()
        time_layer(layer, x, device=torch.device("cpu"), warmup=0, repeats=1, target_spread=None)
        alone += _minor_faults() - f0
    return whole, alone


def saved_bytes(seq, ids) -> int:  # type: ignore[no-untyped-def]
    static = set().union(*(static_storage_keys(layer) for layer in seq.layers))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage_key(t) not in static:
            saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = seq(ids)
    del out
    return sum(saved.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--small", action="store_true", help="a GPT-2 of 6 blocks x 256 (vocabulary 8192), 4 x 128 tokens")
    ap.add_argument("--cpu-time", action="store_true", help="time in this thread's CPU time (user + system), not wall clock")
    opts = ap.parse_args()
    if opts.cpu_time:
        time.perf_counter = time.thread_time  # the profiler's and this script's clocks alike
    torch.set_num_threads(opts.threads)
    # As profile() and autopipe.runtime do on CPU; else page faults of memory glibc returned to the OS
    # cost the unsplit model ~20% of its step here, which no layer timed alone pays.
    keep_freed_memory()
    torch.manual_seed(0)
    size = dict(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=opts.seq_len, bos_token_id=0,
                eos_token_id=0) if opts.small else {}  # fmt: skip
    rows = 4 if opts.small else opts.batch_size
    model = GPT2LMHeadModel(GPT2Config(use_cache=False, **size))
    ids = torch.randint(0, model.config.vocab_size, (rows, opts.seq_len))
    seq = autopipe.flatten(model, (ids,))
    seq.train()  # as the profiler measures: training mode, dropout on

    whole = whole_model_times(seq, ids, opts.repeats)
    prof = autopipe.profile(seq, (ids,), repeats=opts.repeats, warmup=3, threads=opts.threads, progress=True)
    whole += whole_model_times(seq, ids, opts.repeats)
    est = autopipe.profile(seq, (ids,), estimate=True, device="cpu", progress=False)
    activation_whole = saved_bytes(seq, ids)
    faults_whole, faults_alone = page_faults(seq, ids)

    # Control in the same run: GPT-2 with untied wte/lm_head. The unsplit tied model also sums the two
    # gradients of the shared 154 MB tensor, which no single layer contains (Profile.tied_grad_time).
    untied = autopipe.flatten(GPT2LMHeadModel(GPT2Config(use_cache=False, tie_word_embeddings=False, **size)), (ids,))
    untied_whole = whole_model_times(untied, ids, opts.repeats)
    untied_prof = autopipe.profile(untied, (ids,), repeats=opts.repeats, warmup=3, threads=opts.threads, progress=False)
    untied_whole += whole_model_times(untied, ids, opts.repeats)
    untied_ratio = sum(c.forward_time + c.backward_time for c in untied_prof.layers) / statistics.median(untied_whole)

    layer_sum = sum(c.forward_time + c.backward_time for c in prof.layers)  # each layer timed alone
    charged_sum = sum(prof.times)  # with the gap the profiler measured and charged
    tied_sum = sum(prof.tied_grad_time.values())
    whole_median = statistics.median(whole)
    measured_share = [t / charged_sum for t in prof.times]
    est_total = sum(est.times)
    est_share = [t / est_total for t in est.times]
    share_err = [abs(a - b) for a, b in zip(measured_share, est_share)]
    activation_sum = sum(c.activation_bytes for c in prof.layers)
    result = {
        "model": ("gpt2-small (6 blocks x 256, vocabulary 8192, random init)" if opts.small
                  else "gpt2 (GPT2Config() defaults, 124M, random init)"),
        "microbatch": [rows, opts.seq_len],
        "allocator": ALLOCATOR_SETTINGS,
        "clock": "thread CPU time" if opts.cpu_time else "wall clock",
        "load_average": os.getloadavg()[0],
        "cpu": prof.device.name,
        "threads": opts.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "repeats": opts.repeats,
        "layers": len(prof.layers),
        "measured_layers": sum(c.source == "measured" for c in prof.layers),
        "layer_sum_s": layer_sum,
        "whole_model_median_s": whole_median,
        "whole_model_spread_s": statistics.quantiles(whole, n=4)[2] - statistics.quantiles(whole, n=4)[0],
        "time_ratio_layers_over_whole": layer_sum / whole_median,
        "charged_sum_s": charged_sum,
        "time_ratio_charged_over_whole": (charged_sum + sum(prof.tied_grad_time.values())) / whole_median,
        "profile_sequence_s": prof.sequence_forward_time + prof.sequence_backward_time,
        "minor_faults_whole": faults_whole,
        "minor_faults_layers_alone": faults_alone,
        "tied_grad_time_s": tied_sum,
        "time_ratio_layers_plus_tied_over_whole": (layer_sum + tied_sum) / whole_median,
        "untied_control_ratio_layers_over_whole": untied_ratio,
        "activation_sum_bytes": activation_sum,
        "whole_model_saved_bytes": activation_whole,
        "activation_ratio": activation_sum / activation_whole,
        "estimate_total_s": est_total,
        "estimate_over_measured": est_total / layer_sum,
        "share_max_abs_error": max(share_err),
        "share_mean_abs_error": sum(share_err) / len(share_err),
        "per_layer": [
            {"name": c.name, "source": c.source, "measured_ms": c.time * 1e3, "measured_share": m,
             "estimated_ms": e.time * 1e3, "estimated_share": s}
            for c, e, m, s in zip(prof.layers, est.layers, measured_share, est_share)
        ],
    }
    name = ("profile-small" if opts.small else "profile") + ("-cputime" if opts.cpu_time else "")
    write_json_atomic(ROOT / f"bench/results/{name}.json", result)
    (ROOT / f"bench/results/{name}.md").write_text(_markdown(result))
    if not opts.small and not opts.cpu_time:  # the saved profile is in wall-clock seconds
        dataclasses.replace(prof, model="gpt2").save(ROOT / "profiles/gpt2-cpu.json")
    print(_markdown(result))


def _markdown(r: dict) -> str:  # type: ignore[type-arg]
    lines = [
        f"# bench_profile: {r['model']}, micro-batch {r['microbatch']}, {r['cpu']}, {r['threads']} thread(s)",
        "",
        f"Allocator: {r['allocator']} (the runtime's); {r['clock']}; load average {r['load_average']:.1f} when the run started.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| sum of per-layer fwd+bwd medians, each layer alone | {r['layer_sum_s'] * 1e3:.1f} ms ({r['measured_layers']} of {r['layers']} layers measured, rest reused) |",
        f"| whole-model fwd+bwd median (spread) | {r['whole_model_median_s'] * 1e3:.1f} ms ({r['whole_model_spread_s'] * 1e3:.1f} ms) |",
        f"| ratio layers alone / whole | {r['time_ratio_layers_over_whole']:.3f} |",
        f"| minor page faults per fwd+bwd: whole model / every layer alone | {r['minor_faults_whole']} / {r['minor_faults_layers_alone']} |",
        f"| the profiler's own whole-model fwd+bwd (Profile.sequence_*_time) | {r['profile_sequence_s'] * 1e3:.1f} ms |",
        f"| ratio (layers + the gap charged to them + tied gradient sum) / whole (goal within 10%) | {r['time_ratio_charged_over_whole']:.3f} |",
        f"| measured sum of the two tied wte/lm_head gradients (Profile.tied_grad_time) | {r['tied_grad_time_s'] * 1e3:.1f} ms |",
        f"| ratio (layers + tied gradient sum) / whole | {r['time_ratio_layers_plus_tied_over_whole']:.3f} |",
        f"| control, same run: untied GPT-2, ratio layers / whole | {r['untied_control_ratio_layers_over_whole']:.3f} |",
        f"| activation bytes: sum of layers / whole model saved | {r['activation_sum_bytes']} / {r['whole_model_saved_bytes']} = {r['activation_ratio']:.3f} |",
        f"| estimate (CPU roofline) total / measured | {r['estimate_total_s'] * 1e3:.1f} / {r['layer_sum_s'] * 1e3:.1f} ms = {r['estimate_over_measured']:.2f} |",
        f"| time share, estimate vs measured: max / mean abs error | {r['share_max_abs_error'] * 100:.1f} / {r['share_mean_abs_error'] * 100:.1f} points |",
        "",
        "| layer | source | measured ms | share | estimated ms | share |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in r["per_layer"]:
        lines.append(f"| {row['name']} | {row['source']} | {row['measured_ms']:.2f} | {row['measured_share'] * 100:.1f}% "
                     f"| {row['estimated_ms']:.2f} | {row['estimated_share'] * 100:.1f}% |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
