"""autopipe's job on each engine against the pipelines a user writes by hand, in one interleaved run.

    python bench/bench_peers.py              # writes bench/results/peers.{json,md}: 29 launches a round, ~23 min quiet at --rounds 2
    python bench/bench_peers.py --stages 2   # the 2-stage half (15 launches, the breakdown included)
    python bench/bench_peers.py --quick      # GPT-2, 2 stages, 1 round, few steps: a check that it all runs
    python bench/bench_peers.py --no-write   # print only
    python bench/bench_peers.py --stages 2 --rounds 3 --out peers-2   # bench/results/peers-2.*: the full table stays

Models: GPT-2-shaped (8 blocks, n_embd 256, tied embedding) and Llama-shaped (8 layers, hidden 256,
untied), vocab 8192, sequence 128, micro-batch 4, 8 micro-batches, AdamW, fp32, dropout 0, on 2 and 4
gloo ranks, one thread each. Each model is profiled once here (one thread, as a rank runs) and
partitioned by autopipe for 1F1B; the job is written once per stage count. Methods, each a torchrun
of its own script (bench/peers/):

- ``autopipe default``: the job ``autopipe convert MODEL --stages S`` writes with its defaults (its own
  profile, engine, schedule and cut), given only the bench's batch shape: what a user gets;
- ``autopipe torch`` / ``autopipe deepspeed``: the generated train.py of autopipe's 1F1B plan for the
  torch engine, run ``--engine torch|deepspeed``;
- ``bare torch``: a hand-written ``PipelineStage`` + ``Schedule1F1B`` at autopipe's cut (hand_torch.py);
- ``bare deepspeed``: a hand-written ``PipelineModule`` at autopipe's cut (hand_deepspeed.py --parts);
- ``deepspeed parameters|uniform|type``: the same, cut by DeepSpeed's ``partition_method``.

The two bare scripts at autopipe's 1F1B cut measure what autopipe adds to its engine (issue 24's goal:
within 3 %); DeepSpeed's own cuts what a DeepSpeed user gets, which the default job is set against
(the goal: at least as fast as the best of them). Every method trains the same weights
(autopipe's seeded initialisation) on the same batches; the first step's loss (before any update) is
checked to agree across methods. Each rank records when each step returned (bench/peers/record.py;
autopipe's jobs through a probe on PYTHONPATH that wraps ``Trainer.step``): the step period, median
over the steps after WARMUP with its IQR, from the first rank; the process CPU time per step summed
over the ranks (less sensitive to other load than wall time); the peak resident set of each rank
(VmHWM: the whole process, imports included). The runs go round by round (``--rounds``, default 1 to
keep the whole bench near 12 minutes; 2 or more on a quiet machine), every method once per round,
so load that drifts hits each alike, the methods' order turned by one each round (round r starts at
the r-th method): on 2026-11-29 (4 stages) the default job, opening each model's round, read 11%
(GPT-2) and 15% (Llama) slower in round 1 than autopipe's 1F1B job run right after it with the same
train.py, plan and cut, and -2% to +3% in rounds 2-3; no method should always take that place. A
DeepSpeed method whose cut another method already runs (DeepSpeed's partition functions, on the
same layers, say so beforehand; checked after the run) is not run twice; the 1-minute load average
is recorded beside each run.

Where a step goes (issue 24, item 1): after the timed rounds, GPT-2 on 2 stages runs once more
per engine, autopipe's job and the bare script, with the steps after WARMUP under torch's
profiler and ranges around each part of a step (bench/peers/labels.py: forward, backward, P2P,
optimizer, gradient norm/clip, tied/dp reduce, data, stats + memory; "other" is the rest of the
step's period), set beside the plan's own forward, backward and P2P terms per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "peers"))
sys.path.insert(0, str(ROOT / "bench"))  # this folder's _notes, when imported from elsewhere
from _notes import write_keeping_notes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PEERS = ROOT / "bench" / "peers"
ROWS, SEQ, MICRO = 4, 128, 8
MODELS = {
    "gpt2": ("GPT2", dict(n_layer=8, n_embd=256, n_head=4, vocab_size=8192, n_positions=SEQ, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)),
    "llama": ("Llama", dict(num_hidden_layers=8, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=8192, max_position_embeddings=SEQ,
                            tie_word_embeddings=False)),
}  # fmt: skip
PROFILED = ["autopipe torch", "bare torch", "autopipe deepspeed", "bare deepspeed"]  # the breakdown's methods
METHODS = ["autopipe default", "autopipe torch", "bare torch", "autopipe deepspeed", "bare deepspeed",
           "deepspeed parameters", "deepspeed uniform", "deepspeed type"]  # fmt: skip
HAND_DS = ["bare deepspeed", "deepspeed parameters", "deepspeed uniform", "deepspeed type"]  # what a DeepSpeed user writes


def load() -> float:
    return os.getloadavg()[0]


def make_jobs(root: Path, model: str, stage_counts: list[int]) -> dict[int, tuple[Path, list[int], float]]:
    """The model's folder, profiled once, and autopipe's job per stage count: (job dir, cut, predicted step)."""
    import torch
    import transformers

    import autopipe
    from autopipe.graph.sources import load_model
    from autopipe.job.converter import convert
    from autopipe.job.folder import JobSettings, emit
    from autopipe.runtime.checks.reserve import runtime_reserve

    kind, cfg = MODELS[model]
    folder = root / model
    arch = f"{kind}LMHeadModel" if kind == "GPT2" else f"{kind}ForCausalLM"
    getattr(transformers, f"{kind}Config")(architectures=[arch], use_cache=False, **cfg).save_pretrained(folder)
    torch.set_num_threads(1)  # as each pipeline rank runs
    spec = load_model(str(folder), device="cpu", batch_size=ROWS, seq_len=SEQ, dropout=0.0)
    seq = autopipe.flatten(spec.model, spec.args, spec.kwargs, validate=False)
    from layers import layer_names

    if len(seq.layers) != len(layer_names(spec.model)):  # the bare scripts index the same layers as the plan
        raise SystemExit(f"{model}: autopipe flattens to {len(seq.layers)} layers, the bare scripts list {layer_names(spec.model)}")
    prof = autopipe.profile(seq, spec.args, spec.kwargs, threads=1, progress=False,
                            reserve=runtime_reserve("cpu", dtype="fp32", config=spec.model.config))  # fmt: skip
    jobs = {}
    for stages in stage_counts:
        plan = autopipe.partition(prof, stages=stages, microbatches=MICRO, schedule="1f1b", recompute="none", engine="torch")
        settings = JobSettings(model=str(folder), stages=stages, microbatches=MICRO, schedule=plan.schedule,
                               batch_size=ROWS, seq_len=SEQ, dtype="fp32")  # fmt: skip
        job = emit(root / f"{model}-pp{stages}", settings=settings, profile=prof, plan=plan, baselines={})
        # the job `autopipe convert MODEL --stages S` writes with its defaults (its own profile, engine,
        # schedule and cut), given only the bench's batch shape
        default = convert(str(folder), stages=stages, microbatches=MICRO, batch_size=ROWS, seq_len=SEQ, progress=False,
                          out=str(root / f"{model}-pp{stages}-default"))  # fmt: skip
        jobs[stages] = (job.job_dir, list(plan.boundaries), float(plan.total_step_time), plan_terms(plan),
                        {"dir": default.job.job_dir, "parts": list(default.plan.boundaries), "schedule": default.plan.schedule,
                         "engine": default.plan.engine or "torch", "predicted": float(default.plan.total_step_time),
                         # what --schedule auto weighed, from the default job's own profile
                         "schedule_steps": dict(default.plan.schedule_steps), "margin": default.plan.schedule_margin})  # fmt: skip
    return jobs


def ds_cuts(folder: Path, stages: int) -> dict[str, list[int]]:
    """The cut each DeepSpeed method makes of the bare scripts' layers (DeepSpeed's own partition
    functions on the layers' parameter counts or types), checked against DeepSpeed's after each run."""
    import transformers
    from deepspeed.runtime.utils import partition_balanced, partition_uniform
    from layers import Block, user_layers

    config = transformers.AutoConfig.from_pretrained(folder)
    with __import__("torch").device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    layers = user_layers(model)
    if getattr(config, "tie_word_embeddings", False):  # the head's TiedLayerSpec builds the embedding
        layers[-1] = layers[0]
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    cuts = {"deepspeed parameters": partition_balanced(counts, stages),
            "deepspeed uniform": partition_uniform(len(layers), stages),
            "deepspeed type": partition_balanced([int(isinstance(x, Block)) for x in layers], stages)}  # fmt: skip
    return {k: [int(x) for x in v] for k, v in cuts.items()}


def plan_terms(plan: object) -> list[dict[str, float]]:
    """The plan's own terms per rank, per step: its chunks' forward, backward and one-way sends, each
    times the micro-batches (the simulated step adds the schedule's waits to these)."""
    m = plan.microbatches
    return [{"forward": plan.stage_forward[r] * m, "backward": plan.stage_backward[r] * m, "p2p": 2 * plan.stage_comm[r] * m}
            for r in range(len(plan.stage_forward))]  # fmt: skip


def command(method: str, job: Path, cut: list[int], steps: int) -> list[str]:
    common = ["--steps", str(steps)]
    if method == "autopipe default":
        default = job.with_name(job.name + "-default")
        return [str(default / "train.py"), *common, "--ckpt-dir", str(default / "ckpt")]
    if method.startswith("autopipe"):
        engine = method.split()[1]
        return [str(job / "train.py"), "--engine", engine, *common, "--ckpt-dir", str(job / f"ckpt-{engine}")]
    model = str(job.parent / job.name.split("-pp")[0])
    cut_arg = ",".join(map(str, cut))
    if method == "bare torch":
        return [str(PEERS / "hand_torch.py"), model, "--parts", cut_arg, *common]
    if method == "bare deepspeed":
        return [str(PEERS / "hand_deepspeed.py"), model, "--parts", cut_arg, *common]
    partition = {"parameters": "parameters", "uniform": "uniform", "type": "type:Block"}[method.split()[1]]
    return [str(PEERS / "hand_deepspeed.py"), model, "--partition", partition, *common]


def run(method: str, job: Path, cut: list[int], stages: int, steps: int, record: Path, profile_from: int = -1) -> dict:
    """One torchrun of ``method``: its per-rank records, the load around it (``profile_from``:
    the steps after it run under torch's profiler, for the breakdown)."""
    record.mkdir(parents=True)
    probe = [str(PEERS / "probe")] if method.startswith("autopipe") else []  # the bare scripts record themselves
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "BENCH_RECORD_DIR": str(record),
           "PYTHONPATH": os.pathsep.join([*probe, str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "DS_ACCELERATOR": "cpu", "BENCH_PROFILE": str(profile_from)}  # fmt: skip
    before = load()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}",
           *command(method, job, cut, steps)]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=job, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{method} on {job.name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    ranks = [json.loads((record / f"rank{r}.json").read_text()) for r in range(stages)]
    parts = json.loads((record / "parts.json").read_text()) if (record / "parts.json").exists() else cut
    return {"ranks": ranks, "parts": parts, "load": [before, load()], "wall": wall}


def summary(runs: list[dict], warmup: int) -> dict:
    """Median and IQR of the step period (first rank), CPU per step over all ranks, peak RSS per rank."""
    periods = [p for r in runs for p in r["ranks"][0]["periods"][warmup:]]
    cpu = [sum(c) for r in runs for c in zip(*(rk["cpu"][warmup:] for rk in r["ranks"]))]
    q = statistics.quantiles(periods, n=4, method="inclusive") if len(periods) > 1 else [periods[0]] * 3
    losses = next(rk["losses"] for rk in runs[0]["ranks"] if rk["losses"])
    return {"step": q[1], "iqr": [q[0], q[2]], "cpu": statistics.median(cpu), "parts": runs[0]["parts"],
            "peak_rss": [max(r["ranks"][i]["peak_rss"] for r in runs) for i in range(len(runs[0]["ranks"]))],
            "first_loss": losses[0], "load": [x for r in runs for x in r["load"]]}  # fmt: skip


def blocks(parts: list[int]) -> str:
    """Layers per stage as a user counts them (embedding, blocks, norm, head)."""
    return " / ".join(str(b - a) for a, b in zip(parts, parts[1:]))


def why(error: str) -> str:
    """The line of a failed run's output that says what failed (short)."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    for key in ("enforce fail", "error:", "Error:"):
        hit = next((x for x in lines if key in x and "ChildFailedError" not in x), None)
        if hit:
            return hit[-240:].replace("|", "/")
    return (lines[-1] if lines else "?")[-240:].replace("|", "/")


def table(results: dict) -> str:
    lines = []
    for name, res in results.items():
        base = res["methods"]["autopipe torch"].get("step", float("nan"))
        lines += [f"\n### {name} (autopipe's 1F1B plan for torch predicts {res['predicted']:.3f} s)\n",
                  "| method | layers per stage | step (median, IQR) | vs autopipe torch | CPU s/step (all ranks) | peak RSS per rank (MiB) | load |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for method, m in res["methods"].items():
            if "failed" in m:
                lines.append(f"| {method} | | failed: {m['failed']} | | | | |")
                continue
            rss = " / ".join(f"{b / 2**20:.0f}" for b in m["peak_rss"])
            label = f"{method} (= {m['same_as']}: same cut)" if m.get("same_as") else method
            if method == "autopipe default" and res.get("default"):
                d = res["default"]
                label += f" ({d['engine']}, {d['schedule']}; plan {d['predicted']:.3f} s)"
            lines.append(f"| {label} | {blocks(m['parts'])} | {m['step']:.3f} s ({m['iqr'][0]:.3f}-{m['iqr'][1]:.3f}) | "
                         f"{m['step'] / base:.2f}x | {m['cpu']:.2f} | {rss} | {min(m['load']):.1f}-{max(m['load']):.1f} |")  # fmt: skip
        ms = res["methods"]
        if all("step" in ms[m] for m in ("autopipe torch", "bare torch", "autopipe deepspeed", "bare deepspeed")):
            bt, bd = ms["bare torch"], ms["bare deepspeed"]
            lines.append(f"\nautopipe over the bare script at its cut: torch {base / bt['step']:.3f}x, "
                         f"deepspeed {res['methods']['autopipe deepspeed']['step'] / bd['step']:.3f}x")  # fmt: skip
        hand = {m: ms[m]["step"] for m in HAND_DS if "step" in ms[m]}
        if "step" in ms["autopipe default"] and hand:
            best = min(hand, key=hand.get)
            lines.append(f"autopipe's default job over the best hand-written DeepSpeed pipeline ({best}): "
                         f"{ms['autopipe default']['step'] / hand[best]:.3f}x")
        steps = (res.get("default") or {}).get("schedule_steps")
        if steps:  # what the default's schedule choice weighed (its own profile), and under which margin
            lines.append("the default's schedules as planned: " + ", ".join(f"{s} {t:.3f} s" for s, t in steps.items())
                         + f" (the simplest within {res['default'].get('margin', 0):.0%} of the least kept)")
    return "\n".join(lines) + "\n"


def breakdown_table(results: dict) -> str:
    """Seconds per step by part, per rank, from the profiled runs, beside the plan's own terms."""
    from labels import PARTS

    lines = []
    for name, res in results.items():
        if not res.get("breakdown"):
            continue
        lines += [f"\n### {name}: where a step goes (s per step under torch's profiler, which slows a step; plan: its forward, backward, p2p terms)\n",
                  "| method | rank | " + " | ".join(PARTS) + " | other | step |", "| --- " * (len(PARTS) + 4) + "|"]  # fmt: skip
        for method, ranks in res["breakdown"].items():
            for r, b in enumerate(ranks):
                other = b["step"] - sum(b[p] for p in PARTS)
                lines.append(f"| {method} | {r} | " + " | ".join(f"{b[p]:.3f}" for p in PARTS) + f" | {other:.3f} | {b['step']:.3f} |")
        for r, t in enumerate(res["plan_terms"]):
            cells = [f"{t[p]:.3f}" if p in t else "" for p in PARTS]
            lines.append(f"| plan | {r} | " + " | ".join(cells) + f" |  | {res['predicted']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 at 2 stages, 1 round, 5 steps: checks the bench runs")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of every run (default 1; 2+ on a quiet machine)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 10: the first 2 are warm-up)")
    ap.add_argument("--models", default=",".join(MODELS), help="a subset: gpt2, llama")
    ap.add_argument("--stages", default="2,4", help="a subset: 2, 4")
    ap.add_argument("--out", default="peers", help="results name in bench/results (peers-2 for a 2-stage run, say)")
    a = ap.parse_args()
    models, stage_counts = a.models.split(","), [int(x) for x in a.stages.split(",")]
    if a.quick:
        models, stage_counts = ["gpt2"], [2]
    rounds = a.rounds or 1
    steps, warmup = a.steps or (5 if a.quick else 10), 2
    started, t_start = load(), time.perf_counter()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="bench_peers_") as tmp:
        root = Path(tmp)
        configs = []
        defaults: dict = {}  # per configuration: the default job's cut, schedule, engine and prediction
        for model in models:
            for stages, (job, cut, predicted, terms, default) in make_jobs(root, model, stage_counts).items():
                configs.append((f"{model}, {stages} stages", job, cut, stages, predicted, terms))
                defaults[f"{model}, {stages} stages"] = default
        raw: dict = {name: {m: [] for m in METHODS} for name, *_ in configs}
        same: dict = {}  # per configuration: DeepSpeed methods whose cut another method runs already
        predicted_cuts: dict = {}
        for name, job, cut, stages, *_ in configs:
            cuts = {"bare deepspeed": cut, **ds_cuts(job.parent / job.name.split("-pp")[0], stages)}
            predicted_cuts[name] = cuts
            first = {}
            for method, c in cuts.items():
                first.setdefault(tuple(c), method)
            same[name] = {m: first[tuple(c)] for m, c in cuts.items() if first[tuple(c)] != m}
        failed: dict = {name: {} for name, *_ in configs}  # a method that fails is reported, the bench goes on
        for rnd in range(rounds):
            order = METHODS[rnd % len(METHODS):] + METHODS[:rnd % len(METHODS)]  # each round opened by another
            for name, job, cut, stages, *_ in configs:
                for method in order:
                    if method in same[name] or method in failed[name]:
                        continue
                    try:
                        at = defaults[name]["parts"] if method == "autopipe default" else cut
                        out = run(method, job, at, stages, steps, root / "records" / f"{rnd}-{job.name}-{method.replace(' ', '_')}")
                    except RuntimeError as e:
                        failed[name][method] = why(str(e))
                        print(f"round {rnd + 1}/{rounds} {name:<16} {method:<21} FAILED: {failed[name][method]}", flush=True)
                        continue
                    raw[name][method].append(out)
                    print(f"round {rnd + 1}/{rounds} {name:<16} {method:<21} {statistics.median(out['ranks'][0]['periods'][warmup:]):.3f} s "
                          f"load {out['load'][0]:.1f}", flush=True)  # fmt: skip
        profiled: dict = {}
        profile_at = next((c[0] for c in configs if c[3] == 2), None)  # GPT-2's, when it runs
        for name, job, cut, stages, *_ in configs:  # the breakdown: one profiled run each, on one 2-stage model
            if name != profile_at:
                continue
            for method in PROFILED:
                if method in failed[name]:
                    continue
                try:
                    out = run(method, job, cut, stages, steps, root / "records" / f"prof-{job.name}-{method.replace(' ', '_')}",
                              profile_from=warmup)  # fmt: skip
                except RuntimeError as e:
                    print(f"profiled {name:<16} {method} FAILED: {why(str(e))}", flush=True)
                    continue
                profiled.setdefault(name, {})[method] = [rk["breakdown"] for rk in out["ranks"]]
                print(f"profiled {name:<16} {method}", flush=True)
    results = {}
    for name, job, cut, stages, predicted, terms in configs:
        methods = {m: summary(raw[name][m], warmup) for m in METHODS if m not in same[name] and m not in failed[name]}
        methods.update({m: {"failed": msg} for m, msg in failed[name].items()})
        for m, c in predicted_cuts[name].items():  # DeepSpeed cut where it was predicted to (else the twins are wrong)
            if m not in same[name] and m not in failed[name] and methods[m]["parts"] != c:
                raise SystemExit(f"{name}: {m} cut at {methods[m]['parts']}, predicted {c}")
        for m, twin in same[name].items():  # the same cut: one run stands for both
            methods[m] = {**methods[twin], "same_as": twin}
        methods = {m: methods[m] for m in METHODS}
        ran = {m: x for m, x in methods.items() if "failed" not in x}
        first = next(iter(ran.values()))["first_loss"]
        off = {m: x["first_loss"] for m, x in ran.items() if abs(x["first_loss"] - first) > 1e-4}
        if off:  # different weights, batches or loss: the timings would compare different work
            raise SystemExit(f"{name}: first-step losses differ from {next(iter(ran))}'s {first:.6f}: {off}")
        results[name] = {"cut": cut, "predicted": predicted, "methods": methods, "plan_terms": terms,
                         "breakdown": profiled.get(name, {}), "default": {k: v for k, v in defaults[name].items() if k != "dir"}}  # fmt: skip
    finished = load()
    doc = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "uptime": uptime,
           "load": [started, finished], "rounds": rounds, "steps": steps, "warmup": warmup, "quick": a.quick,
           "seconds": time.perf_counter() - t_start, "results": results}  # fmt: skip
    text = table(results) + breakdown_table(results)
    print(text)
    print(f"{doc['seconds']:.0f} s; load {started:.1f} -> {finished:.1f}; {uptime}")
    if not a.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{a.out}.json").write_text(json.dumps(doc, indent=1) + "\n")
        head = (f"# autopipe against hand-written pipelines (bench/bench_peers.py{''.join(' ' + x for x in sys.argv[1:])})\n\n"
                f"{rounds} round(s) of {steps} steps, median of steps {warmup + 1}-{steps}; {os.cpu_count()} CPUs, "
                f"gloo, one thread per rank; `uptime` at the start: {uptime}; load {started:.1f} -> {finished:.1f}.\n")  # fmt: skip
        write_keeping_notes(RESULTS / f"{a.out}.md", head + text)
        # for `autopipe report PLAN --breakdown`: the profiled configuration's methods, per rank
        rows = [{"method": m, "ranks": ranks} for res in results.values() for m, ranks in res["breakdown"].items()]
        (RESULTS / f"{a.out}-breakdown.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
