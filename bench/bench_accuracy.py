"""How true are the plan's predictions? Predicted vs measured step time and per-rank peak memory.

    python bench/bench_accuracy.py              # every configuration; writes bench/results/accuracy.{json,md}
    python bench/bench_accuracy.py --rounds 4   # the recorded run: 4 runs each, ~27 min on a quiet 2-core machine
    python bench/bench_accuracy.py --only gpt2-pp2-1f1b-fp32-none   # one (comma-separated names)

Each configuration is a real job: a GPT-2 or Llama config (random weights) profiled on this CPU with
one thread per process, in the mode train.py trains in (autocast for bf16), partitioned for its
stages / schedule / recompute, written with the generated train.py, and trained under torchrun
(gloo, one thread per rank). Each run (``--rounds``, interleaved) is profiled, planned and written
afresh just before it runs, as ``autopipe convert`` does: a profile reads the machine's speed of its
minute, and one profile shared by every job of a model moved all of them together (one draw put six
GPT-2 jobs at 1.03-1.11 where the runs before read 0.99-1.05); ``--profile model`` shares one. The step log's measured step time (median after warm-up) and each
rank's peak memory (``autopipe.runtime.logs.peak``: peak RSS above the rank's baseline) are set against
the plan's ``step_time`` and ``rank_memory`` (``autopipe.report.steplog.compare``). The goal (issue
24) is every 2-stage step within ±5 % and every memory within ±10 % on this CPU.

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
sys.path.insert(0, str(ROOT / "bench"))  # this folder's _notes, when imported from elsewhere
from _notes import write_keeping_notes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
ROWS, SEQ, STEPS, WARMUP = 4, 128, 6, 2
# the memory run: its peaks are read from the 5th step of 12 on, as a long run holds them (and as the
# reserve probe reads them: autopipe/runtime/checks/reserve.py)
MEMORY_STEPS, MEMORY_SETTLED = 12, 4

MODELS = {
    "gpt2": ("GPT2", dict(n_layer=6, n_embd=256, n_head=4, vocab_size=4096, n_positions=SEQ,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    # the shape issue 24 measured (8 blocks, n_embd 256, vocab 8192; its micro-batch 4 x 128, 8 micro-batches)
    "gpt2i24": ("GPT2", dict(n_layer=8, n_embd=256, n_head=4, vocab_size=8192, n_positions=SEQ,
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
    engine: str = "torch"

    @property
    def name(self) -> str:
        ds = "-deepspeed" if self.engine == "deepspeed" else ""
        mb = f"-m{self.microbatches}" if self.microbatches != (4 if self.stages == 2 else 8) else ""
        return f"{self.model}-pp{self.stages}-{self.schedule}-{self.dtype}-{self.recompute}{mb}{ds}"


CONFIGS = [
    Config("gpt2i24", 2, "1f1b", "fp32", "none", microbatches=8),
    Config("gpt2i24", 2, "1f1b", "fp32", "none", microbatches=8, engine="deepspeed"),
    Config("gpt2", 2, "1f1b", "fp32", "none", engine="deepspeed"),
    Config("llama", 2, "1f1b", "fp32", "none", engine="deepspeed"),
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


def traced(folder: Path, cfg: Config) -> tuple[object, object, int]:
    """The model's load spec, its flattened layers and this machine's runtime reserve for ``cfg``'s
    dtype: what each profile of it needs, made once."""
    import autopipe
    from autopipe.graph.sources import load_model
    from autopipe.runtime.checks.reserve import runtime_reserve

    spec = load_model(str(folder), device="cpu", batch_size=ROWS, seq_len=SEQ, dropout=0.0)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
    return spec, seq, runtime_reserve("cpu", dtype=cfg.dtype, config=spec.model.config)


def profile_of(model: tuple[object, object, int], cfg: Config) -> object:
    """One profile on this CPU with one thread per process, in the mode train.py trains in (autocast for bf16)."""
    import torch

    import autopipe
    from autopipe.choices import PRECISIONS

    spec, seq, reserve = model
    torch.set_num_threads(1)  # as each pipeline rank runs
    autocast = PRECISIONS[cfg.dtype] if cfg.dtype != "fp32" else None
    return autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False, autocast=autocast,  # type: ignore[attr-defined]
                            reserve=reserve)  # fmt: skip


def plan_for(prof: object, cfg: Config, boundaries: list[int] | None = None) -> object:
    """The plan for ``cfg``'s stages / schedule / recompute, made for the engine its job trains on
    (that engine's measured overheads: autopipe/costs/engines.py); ``boundaries``: cost this cut."""
    import autopipe

    return autopipe.partition(prof, stages=cfg.stages, microbatches=cfg.microbatches, schedule=cfg.schedule,
                              recompute=cfg.recompute, engine=cfg.engine, boundaries=boundaries)  # fmt: skip


def write_job(root: Path, folder: Path, cfg: Config, prof: object, plan: object) -> Path:
    """The job folder train.py runs from, for ``plan``."""
    from autopipe.job.folder import JobSettings, emit

    settings = JobSettings(model=str(folder), stages=cfg.stages, microbatches=plan.microbatches, schedule=plan.schedule,  # type: ignore[attr-defined]
                           batch_size=ROWS, seq_len=SEQ, dtype=cfg.dtype, engine=cfg.engine)  # fmt: skip
    return emit(root / cfg.name, settings=settings, profile=prof, plan=plan, baselines={}).job_dir


def run_job(job: Path, cfg: Config, *, exact_memory: bool = False, steps: int = STEPS) -> list[dict]:
    """The job's step log. ``exact_memory``: under train.py --exact-memory, whose CPU peaks count the
    tensors the plan counts (glibc keeps freed memory; slower steps): the memory run, not timed."""
    log = job / "log.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={cfg.stages}",
           str(job / "train.py"), "--steps", str(steps), "--log-json", str(log),
           *(["--exact-memory"] if exact_memory else [])]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    done = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{cfg.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    from autopipe.report.steplog import read_step_log

    return read_step_log(log)


def whole_steps(records: list[dict], cfg: Config) -> list[float]:
    """Each kept step's whole wall time on rank 0 (schedule, norm, optimizer step, the runtime's own
    work): its tokens over its tokens/s, on both engines (the torch log's step_time is the schedule only)."""
    tokens = ROWS * SEQ * cfg.microbatches
    return [tokens / r["tokens_per_s"] for r in records[WARMUP:]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each configuration, interleaved; medians kept")
    parser.add_argument("--profile", choices=("run", "model"), default="run",
                        help="run: each run is planned from its own profile, taken just before it (as `autopipe "
                             "convert` profiles, plans and writes the job); model: one profile per model and dtype "
                             "plans every run")  # fmt: skip
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results alone")
    parser.add_argument("--no-memory", action="store_true", help="skip each configuration's --exact-memory run")
    parser.add_argument("--json", default="", help="also write this pass's rows here (a partial pass, --no-write, kept)")
    opts = parser.parse_args()
    import statistics

    from autopipe.report.steplog import compare

    wanted = [c for c in CONFIGS if not opts.only or c.name in opts.only.split(",")]
    models: dict = {}  # (model, dtype) -> traced(): one trace serves every profile of it
    profiles: dict = {}
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = {m: make_folder(root, m) for m in {c.model for c in wanted}}
        memory: dict[str, list[dict]] = {}
        for r in range(opts.rounds):
            for cfg in wanted:
                t0, load0 = time.perf_counter(), os.getloadavg()[0]
                run = runs.setdefault(cfg.name, {"cfg": cfg, "rounds": [], "whole": [], "kept": [], "load": [load0], "seconds": 0.0})
                fresh = opts.profile == "run"  # a profile and plan for every run, or one per model and dtype
                if fresh or "plan" not in run:
                    key = (cfg.model, cfg.dtype)
                    if fresh or key not in profiles:
                        if key not in models:
                            models[key] = traced(folders[cfg.model], cfg)
                        profiles[key] = profile_of(models[key], cfg)
                    run["plan"] = plan_for(profiles[key], cfg)
                    run["job"] = write_job(root / f"round{r}", folders[cfg.model], cfg, profiles[key], run["plan"])
                plan = run["plan"]
                records = run_job(run["job"], cfg)
                (run["job"] / "log.json").unlink()
                whole = whole_steps(records, cfg)
                measured = statistics.median(whole)
                schedule = statistics.median(float(x["step_time"]) for x in records[WARMUP:])
                run["rounds"].append({"predicted": plan.total_step_time, "measured": measured, "ratio": measured / plan.total_step_time,
                                      "predicted_schedule": plan.schedule_step_time, "measured_schedule": schedule,
                                      "boundaries": list(plan.boundaries)})  # fmt: skip
                run["whole"] += whole
                run["kept"] += records[WARMUP:]
                run["load"].append(os.getloadavg()[0])
                run["seconds"] += time.perf_counter() - t0
                print(f"round {r} {cfg.name:<44} whole step {measured:.3f}s / predicted {plan.total_step_time:.3f}s "
                      f"= {measured / plan.total_step_time:.3f} (schedule {schedule / plan.schedule_step_time:.3f})"
                      f"   load {load0:.1f}", flush=True)  # fmt: skip
        if not opts.no_memory:  # one more run each, under --exact-memory, for the peaks alone (its steps are slower)
            for cfg in wanted:
                if cfg.engine == "torch":
                    records = run_job(runs[cfg.name]["job"], cfg, exact_memory=True, steps=MEMORY_STEPS)
                    (runs[cfg.name]["job"] / "log.json").unlink()
                    memory[cfg.name] = records[MEMORY_SETTLED:]
    rows = []
    for name, run in runs.items():
        cfg, plan, rounds = run["cfg"], run["plan"], run["rounds"]  # plan: the last round's, whose job the memory run ran
        cmp = compare(plan, memory.get(name, run["kept"]), warmup=0)
        whole = run["whole"]
        q = statistics.quantiles(whole, n=4, method="inclusive")
        ratios = [x["ratio"] for x in rounds]
        row = {**asdict(cfg), "name": name, **asdict(cmp), "measured_step_time": statistics.median(whole),
               "step_time_spread": q[2] - q[0],
               # each run against the plan it ran (its own profile under --profile run): the median of those
               "predicted_step_time": statistics.median(x["predicted"] for x in rounds),
               "step_ratio": statistics.median(ratios), "round_ratios": ratios, "rounds": rounds,
               # with a profile per run, a low one is a slow profile or a quick run
               "lowest_run_ratio": min(ratios), "profile": opts.profile,
               # on shared cores (4 ranks on 2) the schedule the plan predicts is the processor-sharing replay's
               "predicted_schedule": statistics.median(x["predicted_schedule"] for x in rounds),
               "predicted_after_schedule": statistics.median(x["predicted"] - x["predicted_schedule"] for x in rounds),
               "schedule_ratio": (statistics.median(x["measured_schedule"] / x["predicted_schedule"] for x in rounds)
                                  if cfg.engine == "torch" else None),
               "memory_ratios": list(cmp.memory_ratios), "boundaries": list(plan.boundaries),
               "stage_recompute": list(getattr(plan, "stage_recompute", ()) or ()), "steps": len(whole),
               "shared_cores": cfg.stages > (os.cpu_count() or 1), "seconds": run["seconds"],
               "load": [min(run["load"]), max(run["load"])]}  # fmt: skip
        rows.append(row)
        mem = " ".join(f"{m:.2f}" for m in cmp.memory_ratios)
        each = " ".join(f"{x:.3f}" for x in ratios)
        print(f"{name:<44} step {row['measured_step_time']:.3f}s (iqr {q[2] - q[0]:.3f}) / {row['predicted_step_time']:.3f}s:"
              f" ratio {row['step_ratio']:.3f} (runs {each})   memory {mem}", flush=True)  # fmt: skip
    if opts.json:
        Path(opts.json).write_text(json.dumps({"configs": rows}, indent=1, default=str) + "\n")
    if not opts.no_write:
        write_results(rows)


def write_results(rows: list[dict], meta: dict | None = None) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    meta = meta or {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
                    "load_average_end": os.getloadavg()[0], "steps": STEPS, "warmup": WARMUP, "rows": ROWS, "seq": SEQ}  # fmt: skip
    (RESULTS / "accuracy.json").write_text(json.dumps({"meta": meta, "configs": rows}, indent=1) + "\n")
    two = [r for r in rows if r["stages"] == 2]
    step5 = sum(1 for r in two if abs(r["step_ratio"] - 1) <= 0.05)
    measured = [r for r in two if r["memory_ratios"] and all(m == m and m > 0 for m in r["memory_ratios"])]  # no nan: DeepSpeed logs none
    mem10 = sum(1 for r in measured if all(abs(m - 1) <= 0.1 for m in r["memory_ratios"]))
    mem_rows = len(measured)
    run5 = sum(1 for r in two for x in r["round_ratios"] if abs(x - 1) <= 0.05)
    runs2 = sum(len(r["round_ratios"]) for r in two)
    profile = rows[0]["profile"] if rows else "run"
    lines = [
        "# Accuracy: the plan's predictions against real runs",
        "",
        f"`python bench/bench_accuracy.py`; {meta['cpus']} CPUs, one thread per rank, {STEPS} steps per run "
        f"(the first {WARMUP} skipped), micro-batch {ROWS}×{SEQ}; load average at the end {meta['load_average_end']:.1f}.",
        "Each plan is made for the engine its job trains on (`partition(..., engine=...)`: that engine's overheads measured by "
        "`bench/bench_engines.py`, autopipe/costs/engine_costs.json). Step: the measured whole step (rank 0's wall time: "
        "schedule, norm, optimizer step, the runtime's own work; median over the runs, IQR) against the plan's "
        "`total_step_time` (the simulated schedule + `step_overhead`). Schedule: on torch the log's own schedule time "
        "against the plan's `step_time`. Memory: measured peak / predicted, per pipeline rank, from one more run under "
        "`train.py --exact-memory` (glibc keeps freed memory, so a CPU rank's peak counts tensors as the plan does; the "
        "DeepSpeed job logs none). "
        "Ratio: each run's median step against the plan that run trained (under `--profile run`, the default, every "
        "run is profiled, planned and written afresh just before it runs, as `autopipe convert` does, so no two runs "
        "share a profile's draw); the median of the runs' ratios, each listed beside it. "
        "Lowest run's ratio: the least of them (with a profile per run, a low one is a slow profile or a quick run). "
        "Load: the 1-minute load average over the configuration's runs (2 cores; above 2 the ranks wait).",
        f"Profiles: {'one per run' if profile == 'run' else 'one per model and dtype, for every run'}. "
        f"2 stages: {step5} of {len(two)} steps within ±5 % (runs: {run5} of {runs2}); "
        f"{mem10} of {mem_rows} memories within ±10 % on every rank.",
        "",
        "| configuration | engine | cut | measured step | predicted (schedule + after) | ratio | each run's ratio | lowest run's ratio | schedule ratio | memory ratio per rank | load |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        shared = " (ranks share cores)" if r["shared_cores"] else ""
        sched = f"{r['schedule_ratio']:.3f}" if r.get("schedule_ratio") else "-"
        mem = " ".join(f"{m:.2f}" for m in r["memory_ratios"]) if any(r["memory_ratios"]) else "-"
        cuts = " / ".join(dict.fromkeys(" ".join(map(str, x["boundaries"])) for x in r["rounds"]))
        each = " ".join(f"{x:.3f}" for x in r["round_ratios"])
        lines.append(
            f"| {r['name']}{shared} | {r['engine']} | {cuts} | {r['measured_step_time']:.3f} s "
            f"({r['step_time_spread']:.3f}) | {r['predicted_step_time']:.3f} s ({r['predicted_schedule']:.3f} + "
            f"{r['predicted_after_schedule']:.3f}) | {r['step_ratio']:.3f} | {each} | {r['lowest_run_ratio']:.3f} | {sched} | {mem} | {r['load'][0]:.1f}-{r['load'][1]:.1f} |"
        )
    write_keeping_notes(RESULTS / "accuracy.md", "\n".join(lines))


if __name__ == "__main__":
    main()
