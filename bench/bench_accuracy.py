"""How true are the plan's predictions? Predicted vs measured step time and per-rank peak memory.

    python bench/bench_accuracy.py              # every configuration; writes bench/results/accuracy.{json,md}
    python bench/bench_accuracy.py --only gpt2-pp2-1f1b-fp32-none   # one (comma-separated names)

Each configuration is a real job: a GPT-2 or Llama config (random weights) profiled on this CPU with
one thread per process, in the mode train.py trains in (autocast for bf16), partitioned for its
stages / schedule / recompute, written with the generated train.py, and trained under torchrun
(gloo, one thread per rank). The step log's measured step time (median after warm-up) and each
rank's peak memory (``autopipe.runtime.peak``: peak RSS above the rank's baseline) are set against
the plan's ``step_time`` and ``rank_memory`` (``autopipe.report.steplog.compare``). The goal is every
configuration within ±10 % on this CPU.

The machine is shared and has 2 cores: the load average is recorded, each configuration's step-time
spread (IQR) is printed beside its median, and configurations with more ranks than cores are marked
(their ranks share cores, which the plan's simulator does not model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
ROWS, SEQ, STEPS, WARMUP = 4, 128, 6, 2

MODELS = {
    "gpt2": ("GPT2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=4096, n_positions=SEQ,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "llama": ("Llama", dict(num_hidden_layers=6, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=4096, max_position_embeddings=SEQ,
                            tie_word_embeddings=False)),
}  # fmt: skip


@dataclass(frozen=True)
class Config:
    model: str
    stages: int
    schedule: str
    dtype: str
    recompute: str
    microbatches: int = 4

    @property
    def name(self) -> str:
        return f"{self.model}-pp{self.stages}-{self.schedule}-{self.dtype}-{self.recompute}"


CONFIGS = [
    Config("gpt2", 2, "1f1b", "fp32", "none"),
    Config("gpt2", 2, "gpipe", "fp32", "none"),
    Config("gpt2", 2, "1f1b", "bf16", "none"),
    Config("gpt2", 2, "1f1b", "fp32", "full"),
    Config("gpt2", 2, "interleaved1f1b", "fp32", "none"),
    Config("gpt2", 2, "zbv", "fp32", "none"),
    Config("gpt2", 4, "1f1b", "fp32", "none", microbatches=8),
    Config("gpt2", 4, "interleaved1f1b", "bf16", "full", microbatches=8),
    Config("llama", 2, "1f1b", "fp32", "none"),
    Config("llama", 2, "1f1b", "bf16", "full"),
    Config("llama", 2, "zbv", "bf16", "none"),
    Config("llama", 2, "interleaved1f1b", "fp32", "full"),
    Config("llama", 4, "1f1b", "fp32", "full", microbatches=8),
    Config("llama", 4, "zbv", "fp32", "none", microbatches=8),
]


def make_folder(root: Path, model: str) -> Path:
    import transformers

    kind, cfg = MODELS[model]
    folder = root / model
    config_cls = getattr(transformers, f"{kind}Config")
    config_cls(architectures=[f"{kind}LMHeadModel" if kind == "GPT2" else f"{kind}ForCausalLM"], use_cache=False,
               **cfg).save_pretrained(folder)  # fmt: skip
    return folder


def make_job(root: Path, folder: Path, cfg: Config, profiles: dict) -> tuple[Path, object]:
    """Profile once per (model, dtype), then partition and write this configuration's job."""
    import autopipe
    from autopipe.choices import PRECISIONS
    from autopipe.graph.sources import load_model
    from autopipe.job.folder import JobSettings, emit
    from autopipe.runtime.reserve import runtime_reserve

    key = (cfg.model, cfg.dtype)
    if key not in profiles:
        import torch

        torch.set_num_threads(1)  # as each pipeline rank runs
        spec = load_model(str(folder), device="cpu", batch_size=ROWS, seq_len=SEQ, dropout=0.0)
        seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
        autocast = PRECISIONS[cfg.dtype] if cfg.dtype != "fp32" else None
        profiles[key] = autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False, autocast=autocast,
                                         reserve=runtime_reserve("cpu", dtype=cfg.dtype, config=spec.model.config))  # fmt: skip
    prof = profiles[key]
    plan = autopipe.partition(prof, stages=cfg.stages, microbatches=cfg.microbatches, schedule=cfg.schedule,
                              recompute=cfg.recompute)  # fmt: skip
    settings = JobSettings(model=str(folder), stages=cfg.stages, microbatches=plan.microbatches, schedule=plan.schedule,
                           batch_size=ROWS, seq_len=SEQ, dtype=cfg.dtype)  # fmt: skip
    job = emit(root / cfg.name, settings=settings, profile=prof, plan=plan, baselines={})
    return job.job_dir, plan


def run_job(job: Path, cfg: Config) -> list[dict]:
    log = job / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.stages}",
           str(job / "train.py"), "--steps", str(STEPS), "--log-json", str(log)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{cfg.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    from autopipe.report.steplog import read_step_log

    return read_step_log(log)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results alone")
    opts = parser.parse_args()
    from autopipe.report.steplog import compare

    wanted = [c for c in CONFIGS if not opts.only or c.name in opts.only.split(",")]
    rows = []
    profiles: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = {m: make_folder(root, m) for m in {c.model for c in wanted}}
        for cfg in wanted:
            t0, load0 = time.perf_counter(), os.getloadavg()[0]
            job, plan = make_job(root, folders[cfg.model], cfg, profiles)
            records = run_job(job, cfg)
            cmp = compare(plan, records, warmup=WARMUP)
            row = {**asdict(cfg), "name": cfg.name, **asdict(cmp), "step_ratio": cmp.step_ratio,
                   "memory_ratios": list(cmp.memory_ratios), "boundaries": list(plan.boundaries),
                   "stage_recompute": list(getattr(plan, "stage_recompute", ()) or ()),
                   "shared_cores": cfg.stages > (os.cpu_count() or 1), "seconds": time.perf_counter() - t0,
                   "load": [load0, os.getloadavg()[0]]}  # fmt: skip
            rows.append(row)
            mem = " ".join(f"{r:.2f}" for r in cmp.memory_ratios)
            print(f"{cfg.name:<40} step {cmp.measured_step_time:.3f}s (iqr {cmp.step_time_spread:.3f}) / "
                  f"{cmp.predicted_step_time:.3f}s = {cmp.step_ratio:.2f}   memory {mem}   load {row['load'][0]:.1f}-{row['load'][1]:.1f}",
                  flush=True)  # fmt: skip
    if not opts.no_write:
        write_results(rows)


def write_results(rows: list[dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "load_average_end": os.getloadavg()[0], "steps": STEPS, "warmup": WARMUP, "rows": ROWS, "seq": SEQ}  # fmt: skip
    (RESULTS / "accuracy.json").write_text(json.dumps({"meta": meta, "configs": rows}, indent=1) + "\n")
    within = sum(1 for r in rows if abs(r["step_ratio"] - 1) <= 0.1 and all(abs(m - 1) <= 0.1 for m in r["memory_ratios"]))
    lines = [
        "# Accuracy: the plan's predictions against real runs",
        "",
        f"`python bench/bench_accuracy.py`; {meta['cpus']} CPUs, one thread per rank, {STEPS} steps "
        f"(the first {WARMUP} skipped), micro-batch {ROWS}×{SEQ}; load average at the end {meta['load_average_end']:.1f}.",
        "Step: measured median (IQR) / predicted. Memory: measured peak / predicted, per pipeline rank. "
        "Load: the 1-minute load average as the configuration started and ended (2 cores; above 2 the ranks wait).",
        f"{within} of {len(rows)} configurations within ±10 % on both.",
        "",
        "| configuration | recompute per stage | measured step | predicted | ratio | memory ratio per rank | load |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        shared = " (ranks share cores)" if r["shared_cores"] else ""
        lines.append(
            f"| {r['name']}{shared} | {' '.join(r['stage_recompute']) or '-'} | {r['measured_step_time']:.3f} s "
            f"({r['step_time_spread']:.3f}) | {r['predicted_step_time']:.3f} s | {r['step_ratio']:.2f} | "
            f"{' '.join(f'{m:.2f}' for m in r['memory_ratios'])} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |"
        )
    (RESULTS / "accuracy.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
