"""ep 2 on this CPU: each rank's measured peak against the plan, on every ZeRO stage.

For the tiny balanced Mixtral of tests/moe_skew_models.py (8 experts of 64 x 256, 6 layers; the routed
experts are 95 % of its parameters), ROWS x 32 tokens a micro-batch (at 4 rows its activations fall
under the exact-memory heap's 64 KiB threshold, where the heap's holes among small tensors count
too): ``convert --stages 1 --dp 4 --ep E --zero Z`` for E in (1, 2)
and Z in (0, 1, 3), then the job trains STEPS steps on 4 processes (gloo, one thread each) with
``--exact-memory`` and its peak after the first step (``autopipe.report.steplog.compare``: the
maximum over the kept steps) is set against the plan's ``rank_memory``. At ep 2 the runtime holds
each expert slice whole outside ZeRO's shards (on ZeRO 1 its AdamW state over the dp / ep replicas
holding it); the table also prices the same cut as the memory model did before it knew that
(``planner.memory._expert_part`` at 0: the slices sharded like every other tensor), so the column
"before" says what the fix changed. Memory, not time: 4 ranks on 2 cores do not disturb it.

    python bench/bench_moe_ep_memory.py     # -> bench/results/moe-ep-memory.{json,md}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # this folder's _notes, when imported from elsewhere
from _notes import write_keeping_notes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DP, STAGES, MICRO, STEPS, ROWS = 4, 1, 4, 4, 16
JOBS = tuple((ep, zero) for ep in (1, 2) for zero in (0, 1, 3))
MIB = 2**20


def _job(ep: int, zero: int, work: Path) -> dict:
    from autopipe import Profile, partition
    from autopipe.cluster.evaluate import node_ep_view
    from autopipe.job.converter import convert
    from autopipe.planner import memory

    job = work / f"ep{ep}-zero{zero}"
    result = convert("tests/moe_skew_models.py:mixtral_balanced", stages=STAGES, dp=DP, ep=ep, zero=zero,
                     microbatches=MICRO, seq_len=32, batch_size=ROWS, out=job, progress=False,
                     schedule="1f1b")  # fmt: skip
    plan = result.plan
    whole = Profile.load(job / "profile.json")
    held = memory._expert_part
    memory._expert_part = lambda layer: 0.0  # the memory model before it kept expert slices whole
    try:
        before = partition(node_ep_view(whole, ep, gpus=STAGES * DP, dp=DP), STAGES, microbatches=MICRO, dp=DP,
                           zero=zero, boundaries=plan.boundaries, schedule=plan.schedule,
                           engine=plan.engine or None).rank_memory  # fmt: skip
    finally:
        memory._expert_part = held
    log = job / "log.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "autopipe", "run", str(job), "--steps", str(STEPS), "--log-json", str(log),
                           "--exact-memory"], cwd=job, env=env, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{job.name}: the job failed:\n{(done.stdout + done.stderr)[-3000:]}")
    from autopipe.report.steplog import compare, read_step_log

    cmp = compare(plan, read_step_log(log), warmup=1)
    return {"ep": ep, "zero": zero, "plan_zero": plan.zero, "predicted": list(cmp.predicted_memory),
            "measured": list(cmp.measured_memory), "predicted_before": [int(m) for m in before],
            "ratio": [m / p for m, p in zip(cmp.measured_memory, cmp.predicted_memory)],
            "ratio_before": [m / p for m, p in zip(cmp.measured_memory, before)]}  # fmt: skip


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    os.chdir(ROOT)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_job(ep, zero, Path(tmp)) for ep, zero in JOBS]
    record = {"dp": DP, "stages": STAGES, "microbatches": MICRO, "steps": STEPS, "load_before": load_before,
              "load_after": os.getloadavg()[0], "runs": runs}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe-ep-memory.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# ep on CPU: each rank's measured peak against the plan, ZeRO 0, 1 and 3", "",
             f"`bench/bench_moe_ep_memory.py`: tiny balanced Mixtral, {STAGES} stage x dp {DP}, {MICRO} micro-batches of "
             f"{ROWS} x 32 tokens, "
             f"peak of steps 2-{STEPS} (`--exact-memory`), replica 0; load {load_before:.1f} before, "
             f"{record['load_after']:.1f} after.", "",
             "| ep | ZeRO | predicted (MiB) | measured (MiB) | measured / predicted | predicted before the fix (MiB) "
             "| measured / that |", "|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in runs:
        lines.append(f"| {r['ep']} | {r['zero']} | {r['predicted'][0] / MIB:.1f} | {r['measured'][0] / MIB:.1f} | "
                     f"{r['ratio'][0]:.2f} | {r['predicted_before'][0] / MIB:.1f} | {r['ratio_before'][0]:.2f} |")
    write_keeping_notes(RESULTS / "moe-ep-memory.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
