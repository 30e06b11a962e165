"""ep 2 jobs on this CPU: does the measured step follow the skewed prediction or the balanced one?

For each tiny Mixtral of tests/moe_skew_models.py (routers biased toward two experts, and untouched):
``convert --stages 1 --dp 2 --ep 2`` (two processes: one per core, so the step measures the job, not
the machine's contention), whose plan prices the experts at the profile's p95 skew (autopipe/costs/ep.py,
the all-to-alls and the count exchange at the profile's host's measured gloo figures: DeviceInfo.links);
the same cut priced balanced (``node_ep_view(..., skew="balanced")``); then the job trains STEPS steps
and the median step after WARMUP is set against both predictions. One ep group: each rank holds 4 of
the 8 experts and the busiest rank's share of the slots sets the step. A control: the skewed model at
ep 1 (dp 2, no all-to-all), its plan against its job, says what the host does to a 2-rank job apart
from expert parallelism.

Each job runs ROUNDS times, interleaved over the models (the machine is shared: its load drifts). In
the last round the ranks load bench/_ep_phases/sitecustomize.py, which times every all-to-all (forward
and backward), the count exchange, each MoE layer's forward and its local experts' forward: the
per-term table below sets them against costs/ep.py's terms (ep_terms).

    python bench/bench_moe_ep_step.py     # -> bench/results/moe-ep-step.{json,md}
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # this folder's _notes, when imported from elsewhere
from _notes import write_keeping_notes  # noqa: E402
RESULTS = ROOT / "bench" / "results"
EP, DP, STAGES, MICRO, STEPS, WARMUP, ROUNDS = 2, 2, 1, 4, 24, 6, 3
JOBS = (("mixtral_skewed", EP), ("mixtral_balanced", EP), ("mixtral_skewed", 1))


def _convert(name: str, ep: int, work: Path) -> dict:
    from autopipe import Profile, partition
    from autopipe.cluster.evaluate import node_ep_view
    from autopipe.job.converter import convert

    job = work / f"{name}-ep{ep}"
    result = convert(f"tests/moe_skew_models.py:{name}", stages=STAGES, dp=DP, ep=ep, microbatches=MICRO, seq_len=32,
                     out=job, progress=False, schedule="1f1b")  # fmt: skip
    plan, whole = result.plan, Profile.load(job / "profile.json")
    # both skews priced alike: the plan's cut, engine and options, the whole step (predicted_step: the
    # schedule plus what follows it, as the step log sets it beside each measured step)
    def price(prof, skew: str):  # noqa: ANN001, ANN202
        return partition(node_ep_view(prof, ep, gpus=STAGES * DP, dp=DP, skew=skew), STAGES, microbatches=MICRO, dp=DP,
                         boundaries=plan.boundaries, schedule=plan.schedule, engine=plan.engine or None)

    priced = {skew: price(whole, skew) for skew in ("p95", "balanced")}
    # what the plan said before it priced the ep runner's own ops (MoeShape.local_forward/backward at 0)
    from dataclasses import replace

    untimed = whole.with_layers([replace(l, moe=replace(l.moe, local_forward=0.0, local_backward=0.0)) if l.moe else l
                                 for l in whole.layers])  # fmt: skip
    without_ops = price(untimed, "p95").predicted_step
    # the job's ranks initialise a factory's weights afresh (runtime/stage/weights.py): the biased
    # routers come from the factory's own model, saved
    import moe_skew_models as M
    from safetensors.torch import save_file

    model = getattr(M, name)()[0]
    weights = job / "weights.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    return {"job": str(job), "weights": str(weights), "boundaries": list(plan.boundaries), "schedule": plan.schedule,
            "engine": plan.engine,
            "plan_predicted_step_s": plan.predicted_step, "predicted_p95_s": priced["p95"].predicted_step,
            "predicted_balanced_s": priced["balanced"].predicted_step, "predicted_p95_without_ops_s": without_ops,
            "links": {k: list(v) for k, v in whole.device.links.items()}, "terms": _terms(whole, ep), "rounds": []}  # fmt: skip


def _shared_control(run: dict, source: Path) -> None:
    from autopipe import Profile, partition

    whole = Profile.load(source / "profile.json")
    run["predicted_from_ep2_profile_s"] = partition(whole, STAGES, microbatches=MICRO, dp=DP, boundaries=run["boundaries"],
                                                    schedule=run["schedule"], engine=run["engine"] or None).predicted_step  # fmt: skip


def _terms(whole, ep: int) -> dict:  # noqa: ANN001
    """costs/ep.py's per-micro-batch terms, summed over the MoE layers (p95 and balanced)."""
    from autopipe.cluster.evaluate import node_ep_view
    from autopipe.costs.ep import ep_terms
    from autopipe.costs.links import link_bandwidth

    if ep == 1:
        return {}
    bw = link_bandwidth(whole, "all_to_all") or 5e9
    out = {}
    for skew in ("p95", "balanced"):
        t = ep_terms(whole, ep, bandwidth=bw, skew=skew)
        out[skew] = {"layers": len(t), "forward_compute_s": sum(x.forward_compute for x in t),
                     "backward_compute_s": sum(x.backward_compute for x in t), "all_to_all_s": t[0].all_to_all,
                     "count_exchange_s": t[0].count_exchange, "local_s": sum(x.local for x in t)}  # fmt: skip
    # the profile's own (ep 1) MoE layers, forward + backward, for the compute the ep rank is held to
    prof = node_ep_view(whole, ep, gpus=STAGES * DP, dp=DP)
    out["step_layers_s"] = sum(l.forward_time + l.backward_time for l in prof.layers)
    return out


def _train(run: dict, phases: Path | None) -> dict:
    job = Path(run["job"])
    log = job / "log.json"
    log.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if phases is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "_ep_phases"), env.get("PYTHONPATH", "")])
        env["AUTOPIPE_EP_PHASES"] = str(phases)
    load = os.getloadavg()[0]
    done = subprocess.run([sys.executable, "-m", "autopipe", "run", str(job), "--steps", str(STEPS), "--log-json", str(log),
                           "--weights", run["weights"]], cwd=job, env=env, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{job.name}: the job failed:\n{(done.stdout + done.stderr)[-3000:]}")
    times = [json.loads(line)["step_time"] for line in log.read_text().splitlines()][WARMUP:]
    q = statistics.quantiles(times, n=4)
    return {"median_s": statistics.median(times), "q1_s": q[0], "q3_s": q[2], "steps": len(times),
            "load_before": load, "load_after": os.getloadavg()[0]}  # fmt: skip


def _phases(prefix: Path, ranks: int) -> dict:
    """Per rank, per timed call: calls per step and median seconds per call, over the steps after WARMUP."""
    out = {}
    for r in range(ranks):
        path = Path(f"{prefix}{r}.json")
        if not path.is_file():
            continue
        calls = json.loads(path.read_text())
        calls.update(_split_all_to_alls(calls))
        rank = {}
        for name, cs in calls.items():
            per = len(cs) // STEPS
            kept = [d for _t, d in cs[per * WARMUP:]]
            if kept:
                rank[name] = {"per_step": per, "median_s": statistics.median(kept), "per_step_s": sum(kept) / (STEPS - WARMUP)}
        out[str(r)] = rank
    return out


def _split_all_to_alls(calls: dict) -> dict:
    """The all-to-alls by role, from their time stamps: inside a count exchange (its E integers),
    inside a MoE layer's forward (the first after the count exchange the dispatch, the second the
    combine), else the backward's. The dispatch follows the count exchange at once, so it waits for
    no peer: it is the collective itself; the combine waits for the busier rank's experts."""
    windows = sorted((t, t + d) for t, d in calls.get("moe_forward", []))
    counts = sorted((t, t + d) for t, d in calls.get("count_exchange", []))
    out: dict[str, list] = {"a2a_dispatch": [], "a2a_combine": [], "a2a_backward": []}
    seen: dict[int, int] = {}
    for t, d in calls.get("all_to_all_single", []):
        if any(a <= t <= b for a, b in counts):
            continue
        w = next((i for i, (a, b) in enumerate(windows) if a <= t <= b), None)
        if w is None:
            out["a2a_backward"].append((t, d))
        else:
            seen[w] = seen.get(w, 0) + 1
            out["a2a_dispatch" if seen[w] == 1 else "a2a_combine"].append((t, d))
    return out


def _cpu() -> str:
    try:
        return next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                    if l.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        import platform

        return platform.processor() or "unknown CPU"


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        runs = {f"{name} ep {ep}": _convert(name, ep, work) for name, ep in JOBS}
        # the control priced from the skewed ep 2 job's own profile too (the same model, another convert):
        # a profile taken under the host's load sets every prediction's scale, so the ep terms are read as
        # (ep 2 measured / predicted) against (ep 1 measured / predicted) on one profile
        _shared_control(runs["mixtral_skewed ep 1"], Path(runs["mixtral_skewed ep 2"]["job"]))
        for i in range(ROUNDS):
            for key, run in runs.items():
                last = i == ROUNDS - 1
                prefix = work / f"phases-{key.replace(' ', '-')}-"
                run["rounds"].append(_train(run, prefix if last else None))
                if last:
                    run["phases"] = _phases(prefix, DP)
    for run in runs.values():
        meds = [r["median_s"] for r in run["rounds"]]
        run["measured_median_s"] = statistics.median(meds)
        run["ratio_to_p95"] = run["measured_median_s"] / run["predicted_p95_s"]
        run["ratio_to_balanced"] = run["measured_median_s"] / run["predicted_balanced_s"]
        run["ratio_to_p95_without_ops"] = run["measured_median_s"] / run["predicted_p95_without_ops_s"]
    control = runs["mixtral_skewed ep 1"]
    control["ratio_on_ep2_profile"] = control["measured_median_s"] / control["predicted_from_ep2_profile_s"]
    for key in ("mixtral_skewed ep 2", "mixtral_balanced ep 2"):
        # per round: this job's step over the control's step of the same round (the host's load shared)
        runs[key]["over_control_per_round"] = [a["median_s"] / b["median_s"] for a, b in zip(runs[key]["rounds"], control["rounds"])]
    record = {"ep": EP, "dp": DP, "stages": STAGES, "microbatches": MICRO, "steps": STEPS, "warmup": WARMUP,
              "rounds": ROUNDS, "load_before": load_before, "load_after": os.getloadavg()[0], "runs": runs}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe-ep-step.json").write_text(json.dumps(record, indent=1) + "\n")
    loads = ", ".join(f"{x['load_before']:.1f}" for r in runs.values() for x in r["rounds"])
    lines = ["# ep 2 jobs on CPU: measured step against the skewed (p95) and the balanced prediction", "",
             f"`bench/bench_moe_ep_step.py`: {STAGES} stage × dp {DP}, {MICRO} micro-batches, 1 thread per rank, "
             f"median of steps {WARMUP + 1}-{STEPS}, {ROUNDS} rounds interleaved; host load {load_before:.1f} before, "
             f"{record['load_after']:.1f} after (2 cores; its own 2 ranks make a load of 2); per round "
             f"{loads}; host {_cpu()}.", "",
             "| job | predicted p95 (ms) | p95 without the runner's ops (ms) | predicted balanced (ms) | "
             "measured per round (ms) [IQR of its steps] | measured / p95 | / p95 without the ops | measured / balanced |",
             "|---|---:|---:|---:|---|---:|---:|---:|"]  # fmt: skip
    for key, r in runs.items():
        rounds = "; ".join(f"{x['median_s'] * 1e3:.0f} [{x['q1_s'] * 1e3:.0f}-{x['q3_s'] * 1e3:.0f}]" for x in r["rounds"])
        lines.append(f"| {key} | {r['predicted_p95_s'] * 1e3:.1f} | {r['predicted_p95_without_ops_s'] * 1e3:.1f} | "
                     f"{r['predicted_balanced_s'] * 1e3:.1f} | {rounds} | {r['ratio_to_p95']:.2f} | "
                     f"{r['ratio_to_p95_without_ops']:.2f} | {r['ratio_to_balanced']:.2f} |")  # fmt: skip
    sk = runs["mixtral_skewed ep 2"]
    lines += ["", f"The control, priced on the skewed ep 2 job's profile: {control['predicted_from_ep2_profile_s'] * 1e3:.1f} ms "
              f"predicted, measured / predicted {control['ratio_on_ep2_profile']:.2f}; on the same profile the skewed ep 2 "
              f"job reads {sk['ratio_to_p95']:.2f} of its p95 and {sk['ratio_to_balanced']:.2f} of its balanced "
              f"prediction. Per round, ep 2 over the control's step: skewed "
              f"{', '.join(f'{x:.2f}' for x in sk['over_control_per_round'])} (p95 predicts "
              f"{sk['predicted_p95_s'] / control['predicted_from_ep2_profile_s']:.2f}, balanced "
              f"{sk['predicted_balanced_s'] / control['predicted_from_ep2_profile_s']:.2f}); balanced model "
              f"{', '.join(f'{x:.2f}' for x in runs['mixtral_balanced ep 2']['over_control_per_round'])}."]  # fmt: skip
    lines += ["", "Per term, last round (median ms per call [ms per step]; the ranks' timers, bench/_ep_phases; "
              "a collective's time includes waiting for its peer):", "",
              "| job | rank | all-to-alls / step | all (ms) [ms/step] | dispatch | combine | backward's | "
              "count exchange | MoE layer forward | local experts forward |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for key, r in runs.items():
        for rank, ph in sorted(r.get("phases", {}).items()):
            a2a, cnt = ph.get("all_to_all_single", {}), ph.get("count_exchange", {})
            fw, loc = ph.get("moe_forward", {}), ph.get("local_experts_forward", {})
            if not a2a:
                continue
            cell = lambda x: f"{x.get('median_s', 0) * 1e3:.2f} [{x.get('per_step_s', 0) * 1e3:.0f}]"  # noqa: E731
            roles = " | ".join(cell(ph.get(k, {})) for k in ("a2a_dispatch", "a2a_combine", "a2a_backward"))
            lines.append(f"| {key} | {rank} | {a2a['per_step']} | {cell(a2a)} | {roles} | {cell(cnt)} | {cell(fw)} | {cell(loc)} |")
    for key, r in runs.items():
        if r["terms"]:
            t = r["terms"]["p95"]
            per_step = MICRO * t["layers"] * (4 * t["all_to_all_s"] + t["count_exchange_s"])
            lines.append(f"\n{key} predicted per call: all-to-all {t['all_to_all_s'] * 1e3:.2f} ms, count exchange "
                         f"{t['count_exchange_s'] * 1e3:.2f} ms ({t['layers']} MoE layers, 4 all-to-alls + 1 count "
                         f"exchange each per micro-batch: {per_step * 1e3:.0f} ms a step); the runner's own ops "
                         f"{MICRO * t['local_s'] * 1e3:.1f} ms a step (timed on one rank at convert); the MoE layers' compute "
                         f"{MICRO * (t['forward_compute_s'] + t['backward_compute_s']) * 1e3:.0f} ms a step (forward "
                         f"{MICRO * t['forward_compute_s'] * 1e3:.0f}).")  # fmt: skip
    write_keeping_notes(RESULTS / "moe-ep-step.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
