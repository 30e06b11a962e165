"""What a rank holds beside the tensors it trains: whole weights a pass left behind, per layout.

For bench_accuracy's Llama (6 layers, hidden 256, vocab 4096; fp32 weights 24.6 MiB), one stage:
``convert`` at dp 2 on ZeRO 0 and ZeRO 3, and at tp 2; each job trains 3 steps on 2 processes (gloo,
one thread each, ``--exact-memory``), and at step 3's start each rank records (bench/_held): its
resident set, the bytes it trains with (parameters, gradients, AdamW state), and the bytes of
parameter tensors its model and chunks reach that are none of those. A CPU rank's measured peak is
taken above a baseline that counts such tensors, so no step log shows them; the resident set does.
Memory, not time: 2 ranks on 2 cores do not disturb it.

    python bench/bench_held_weights.py     # -> bench/results/held-weights.{json,md}
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _notes import write_keeping_notes  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LAYOUTS = {"dp 2, ZeRO 0": {"dp": 2, "zero": 0}, "dp 2, ZeRO 3": {"dp": 2, "zero": 3}, "tp 2": {"tp": 2}}
MIB = 2**20


def _layout(folder: Path, work: Path, name: str, kw: dict) -> dict:
    from autopipe.job.converter import convert

    job = work / name.replace(" ", "").replace(",", "-")
    convert(str(folder), stages=1, microbatches=4, batch_size=4, seq_len=128, out=job, progress=False, schedule="1f1b",
            **kw)  # fmt: skip
    prefix = str(job / "held-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "AUTOPIPE_HELD": prefix,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "bench" / "_held"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "autopipe", "run", str(job), "--steps", "3", "--exact-memory"], cwd=job,
                          env=env, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{name}: the job failed:\n{(done.stdout + done.stderr)[-3000:]}")
    ranks = [json.loads(Path(f"{prefix}{r}.json").read_text()) for r in range(2)]
    return {"layout": name, **kw, "ranks": ranks}


def main() -> None:
    from bench_accuracy import make_folder

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = make_folder(work, "llama")
        runs = [_layout(folder, work, name, kw) for name, kw in LAYOUTS.items()]
    record = {"load_before": load_before, "load_after": os.getloadavg()[0], "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "held-weights.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = ["# What a rank holds beside the tensors it trains (bench/bench_held_weights.py)", "",
             f"bench_accuracy's Llama (fp32 weights 24.6 MiB), 1 stage, step 3's start, rank 0 / rank 1; load "
             f"{load_before:.1f} before, {record['load_after']:.1f} after.", "",
             "| layout | trains with (MiB) | reached, not trained (MiB) | resident (MiB) |", "|---|---:|---:|---:|"]  # fmt: skip
    for run in runs:
        cols = [" / ".join(f"{r[k] / MIB:.1f}" for r in run["ranks"]) for k in ("held", "stray", "resident")]
        lines.append(f"| {run['layout']} | {cols[0]} | {cols[1]} | {cols[2]} |")
    write_keeping_notes(RESULTS / "held-weights.md", "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
