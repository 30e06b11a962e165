"""dp 2 × pp 2 on this CPU: ZeRO 0-3 on torch's engines against the hand-written data parallelism they replaced.

    python bench/bench_zero.py               # writes bench/results/zero.{json,md}
    python bench/bench_zero.py --no-write    # print only

One run, one job: a GPT-2-shaped model (tied wte/lm_head, random weights) profiled once on this CPU
with one thread, partitioned into 2 stages (1F1B, 4 micro-batches) for dp 2 under each ZeRO stage,
and trained by the generated train.py on 4 processes (gloo, one thread each) for STEPS steps:

- ``hand-written``: the runtime as it was before issue 12 (``BASE``, extracted from git into a
  temporary folder): one flat all-reduce of every gradient after the backward, AdamW foreach=False;
- ``zero0`` .. ``zero3``: this tree's runtime with ``--zero K`` (ZeRO 0/1 on DistributedDataParallel
  under 1F1B, ZeRO 2/3 on FSDP2);
- ``zero0-replicate``: ZeRO 0 on torch's ``replicate``, the engine ZeRO 0/1 keep for zero-bubble
  schedules (and ran everywhere before), forced here under 1F1B by the probe (bench-side) so DDP and
  replicate are measured in the same run, against the plan's terms for replicate.

For each: the median step time after WARMUP steps and its spread (IQR), the ratio to the
hand-written path measured in the same run, and each pipeline rank's peak memory (replica 0;
``autopipe.runtime.logs.peak``: peak RSS above the rank's baseline, the maximum over the kept steps)
against the plan's ``rank_memory`` for that ZeRO stage. Resident memory also holds what the heap
keeps after frees, so each rank's live tensor bytes are sampled too, in step PROBED only (a probe
put on PYTHONPATH, bench-side: every tensor the process holds, each storage once, after each
forward, backward and gradient reduce of a stage), and set against the plan's tensor terms (its
``rank_memory`` less the measured runtime reserve); that step is left out of the step times. The
machine is shared and has 2 cores for 4 ranks: the load average is recorded before and after.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "bench" / "results"
BASE = "5d10c82"  # main before issue 12: the hand-written data-parallel path
ROWS, SEQ, MICRO, STEPS, WARMUP, DP = 4, 128, 4, 8, 2, 2
ROUNDS = 2  # every run once per round, in turn, so load that drifts over the bench hits each alike
PROBED = STEPS - 1  # 0-based step whose live tensor bytes are sampled (slow: a scan of every object)

PROBE = '''
import gc, json, os
if os.environ.get("BENCH_REPLICATE"):
    import autopipe.runtime.torch_engine.zero as _zero

    _zero.ddp_schedule = lambda schedule: False
if os.environ.get("BENCH_PROBE_DIR"):
    import torch
    from torch.distributed.pipelining import stage as _stage
    import autopipe.runtime.torch_engine.trainer as _trainer

    _state = {"step": 0, "peak": 0}

    def _live():
        seen = {}
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor):
                t = getattr(o, "_local_tensor", o)
                if t.device.type != "meta":
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def _sampled(name):
        run = getattr(_stage._PipelineStageBase, name)

        def wrapped(self, *args, **kwargs):
            out = run(self, *args, **kwargs)
            if _state["step"] == int(os.environ["BENCH_PROBE_STEP"]):
                _state["peak"] = max(_state["peak"], _live())
            return out

        setattr(_stage._PipelineStageBase, name, wrapped)

    for _name in ("forward_one_chunk", "backward_one_chunk", "perform_reduce_grad"):
        _sampled(_name)
    _step = _trainer.Trainer.step

    def _counted_step(self, *args, **kwargs):
        out = _step(self, *args, **kwargs)
        if _state["step"] == int(os.environ["BENCH_PROBE_STEP"]):
            with open(os.path.join(os.environ["BENCH_PROBE_DIR"], f"live{os.environ['RANK']}.json"), "w") as f:
                json.dump(_state["peak"], f)
        _state["step"] += 1
        return out

    _trainer.Trainer.step = _counted_step
'''
MODEL = dict(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
             attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip


def make_folder(root: Path) -> Path:
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"], use_cache=False, **MODEL).save_pretrained(root / "gpt2")
    return root / "gpt2"


def make_plans(root: Path, folder: Path) -> tuple[dict[int, object], object]:
    """Profile once; one plan per ZeRO stage (no memory limit, so the cut is the fastest: the same),
    and the profile."""
    import torch

    import autopipe
    from autopipe.graph.sources import load_model
    from autopipe.runtime.checks.reserve import runtime_reserve

    torch.set_num_threads(1)
    spec = load_model(str(folder), device="cpu", batch_size=ROWS, seq_len=SEQ, dropout=0.0)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
    prof = autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False, reserve=runtime_reserve("cpu"))
    plans = {}
    for zero in (0, 1, 2, 3):
        plan = autopipe.partition(prof, stages=2, microbatches=MICRO, schedule="1f1b", recompute="none",
                                  memory_limit=None, dp=DP, zero=zero)  # fmt: skip
        plan.save(root / f"plan{zero}.json")
        plans[zero] = plan
    return plans, prof


def write_script(src: Path, target: Path, folder: Path) -> None:
    """train.py as the runtime at ``src`` writes it (each runtime runs its own template)."""
    # the writer moved from autopipe.runtime to autopipe.job with the package's pass folders
    code = ("try:\n    from autopipe.job import write_train_script as w\n"
            "except ImportError:\n    from autopipe.runtime import write_train_script as w\n"
            f"w({str(target)!r}, model={str(folder)!r}, stages=2, microbatches={MICRO}, schedule='1f1b', "
            f"batch_size={ROWS}, seq_len={SEQ})")  # fmt: skip
    # cwd outside any checkout: `python -c` puts the cwd first on sys.path
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(src)}, cwd=target.parent)


def run(src: Path, script: Path, plan: Path, log: Path, *flags: str,
        replicate: bool = False) -> tuple[list[dict], list[int]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={2 * DP}", str(script),
           "--steps", str(STEPS), "--plan", str(plan), "--dp", str(DP), "--log-json", str(log),
           "--ckpt-dir", str(log.parent / f"{log.stem}-ckpt"), *flags]  # fmt: skip
    probes = log.parent / f"{log.stem}-live"
    probes.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": os.pathsep.join([str(log.parent / "probe"), str(src)]),
           "BENCH_PROBE_DIR": str(probes), "BENCH_PROBE_STEP": str(PROBED)}  # fmt: skip
    if replicate:
        env["BENCH_REPLICATE"] = "1"
    done = subprocess.run(cmd, cwd=log.parent, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{log.stem} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    live = [json.loads((probes / f"live{r}.json").read_text()) for r in range(2)]  # replica 0's pipeline ranks
    return [json.loads(line) for line in log.read_text().splitlines()], live


def summarise(results: list[tuple[list[dict], list[int]]]) -> dict:
    """One configuration over its rounds: median and IQR of every kept step, each round's median,
    per-rank peaks and live bytes (the largest over the rounds), the first round's losses."""
    import statistics

    times, rounds, peaks, live = [], [], [0, 0], [0, 0]
    for records, sampled in results:
        kept = [r for i, r in enumerate(records) if i >= WARMUP and i != PROBED]
        mine = [float(r["step_time"]) for r in kept]
        times += mine
        rounds.append(statistics.median(mine))
        peaks = [max(peaks[i], *(int(r["peak_memory"][i]) for r in kept)) for i in range(2)]
        live = [max(live[i], sampled[i]) for i in range(2)]
    q = statistics.quantiles(times, n=4, method="inclusive")
    return {"step_time": statistics.median(times), "spread": q[2] - q[0], "round_medians": rounds, "peaks": peaks,
            "live": live, "losses": [r["loss"] for r in results[0][0]]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results alone")
    opts = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = root / "base"
        base.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASE, "autopipe"], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive.stdout, check=True)
        (root / "probe").mkdir()
        (root / "probe" / "sitecustomize.py").write_text(PROBE)
        folder = make_folder(root)
        plans, prof = make_plans(root, folder)
        cut = root / "cut.json"  # the old runtime reads a plan without dp/zero: give it the same cut
        cut.write_text(json.dumps({"boundaries": list(plans[0].boundaries)}))
        write_script(base, root / "train_base.py", folder)
        write_script(ROOT, root / "train.py", folder)
        t0 = time.perf_counter()
        names = ("hand-written", "zero0", "zero0-replicate", "zero1", "zero2", "zero3")
        runs: dict[str, list] = {name: [] for name in names}
        for i in range(ROUNDS):
            runs["hand-written"].append(run(base, root / "train_base.py", cut, root / f"hand-written-{i}.json"))
            for zero in (0, 1, 2, 3):
                runs[f"zero{zero}"].append(run(ROOT, root / "train.py", root / f"plan{zero}.json",
                                               root / f"zero{zero}-{i}.json", "--zero", str(zero)))  # fmt: skip
                if zero == 0:
                    runs["zero0-replicate"].append(run(ROOT, root / "train.py", root / "plan0.json",
                                                       root / f"zero0-replicate-{i}.json", "--zero", "0", replicate=True))
            print(f"round {i + 1} of {ROUNDS} done, load {os.getloadavg()[0]:.1f}", flush=True)
        rows["hand-written"] = summarise(runs["hand-written"])
        from autopipe.planner.memory import layer_memory, rank_memory

        for name in names[1:]:
            zero = int(name[4])
            plan = plans[zero]
            terms = [dict(m) for m in plan.rank_memory_breakdown]
            if name.endswith("replicate"):
                # replicate's ZeRO terms (a zero-bubble schedule's engine) on the same 1F1B cut and run:
                # the layers' shares as under zbv, the schedule's own terms (no held sends) as 1F1B's
                lm = layer_memory(prof, dp=DP, zero=zero, schedule="zbv")
                terms = [m.to_dict() for m in rank_memory(
                    lm, plan.boundaries, stage_ranks=plan.stage_ranks, inflight=plan.stage_inflight,
                    microbatches=plan.microbatches, recompute=plan.stage_recompute, reserve=prof.reserve_bytes,
                    schedule="1f1b")]  # fmt: skip
            rows[name] = summarise(runs[name])
            rows[name]["predicted"] = [int(t["total"]) for t in terms]
            rows[name]["predicted_tensors"] = [int(t["total"]) - int(t["reserve"]) for t in terms]
            rows[name]["predicted_terms"] = terms
            print(name, rows[name], flush=True)
        seconds = time.perf_counter() - t0
    base_time = rows["hand-written"]["step_time"]
    for r in rows.values():
        r["ratio"] = r["step_time"] / base_time
    meta = {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine(),
            "load_before": load_before, "load_after": os.getloadavg()[0], "steps": STEPS, "warmup": WARMUP,
            "rows": ROWS, "seq": SEQ, "microbatches": MICRO, "rounds": ROUNDS, "dp": DP, "model": MODEL, "base": BASE,
            "boundaries": list(plans[0].boundaries), "seconds": seconds}  # fmt: skip
    print(f"load {meta['load_before']:.1f} before, {meta['load_after']:.1f} after", flush=True)
    if not opts.no_write:
        write_results(meta, rows)


def write_results(meta: dict, rows: dict[str, dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "zero.json").write_text(json.dumps({"meta": meta, "runs": rows}, indent=1) + "\n")
    mib = lambda b: f"{b / 2**20:.0f}"  # noqa: E731
    lines = [
        "# ZeRO 0-3 on torch's engines against the hand-written data parallelism (dp 2 × pp 2, CPU)",
        "",
        f"`python bench/bench_zero.py`: GPT-2-shaped model ({MODEL['n_layer']} blocks, width {MODEL['n_embd']}, "
        f"vocabulary {MODEL['vocab_size']}, tied wte/lm_head), cut {meta['boundaries']}, 1F1B, {MICRO} micro-batches of "
        f"{ROWS}×{SEQ} per replica, 4 processes with one thread each on {meta['cpus']} shared CPUs (ranks share "
        f"cores), {STEPS} steps, the first {WARMUP} and step {PROBED + 1} (probed) left out of the times. Load average {meta['load_before']:.1f} before, "
        f"{meta['load_after']:.1f} after (the machine is shared with other work).",
        "",
        f"Each run {ROUNDS} times, the runs in turn. Step: median (IQR) over the kept steps of both rounds "
        "[each round's median], and its ratio to the hand-written path in this run. Peak: each "
        "pipeline rank's (replica 0) peak resident memory above its baseline as the step log measures it, MiB, "
        "against the plan's `rank_memory` for that ZeRO stage. Live: the most tensor bytes the rank held at a "
        f"stage-op boundary of step {PROBED + 1}, against the plan's tensor terms (`rank_memory` less its "
        "runtime reserve). The hand-written path has no prediction (the old plan charged a flat gradient buffer). "
        "ZeRO 0/1 run on DistributedDataParallel (1F1B runs whole backwards); `zero0-replicate` is ZeRO 0 on "
        "torch's `replicate` (the zero-bubble schedules' engine), planned with replicate's terms.",
        "",
        "| run | step | vs hand-written | peak r0 / plan | peak r1 / plan | live r0 / plan | live r1 / plan |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        def pair(measured: int, planned: int | None) -> str:
            return f"{mib(measured)} / {mib(planned)} ({measured / planned:.2f})" if planned else f"{mib(measured)} / -"

        pred = r.get("predicted") or [None, None]
        tens = r.get("predicted_tensors") or [None, None]
        each = " ".join(f"{t:.2f}" for t in r["round_medians"])
        lines.append(f"| {name} | {r['step_time']:.3f} s ({r['spread']:.3f}) [{each}] | {r['ratio']:.2f} | "
                     f"{pair(r['peaks'][0], pred[0])} | {pair(r['peaks'][1], pred[1])} | "
                     f"{pair(r['live'][0], tens[0])} | {pair(r['live'][1], tens[1])} |")
    (RESULTS / "zero.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
