"""How long a mistake takes to be said: seconds from the command's start to its one error line.

    python bench/bench_fail_fast.py              # 5 runs of each, medians with min-max; bench/results/fail-fast.md
    python bench/bench_fail_fast.py --runs 3 --no-write

Each case is a mistake that needs no model (a checkpoint folder, --resume, the process count, a
flag, a data file): `python train.py`, `autopipe run JOB` and `autopipe convert` should say it
before they build or trace the model (tests/test_fail_fast.py checks that the model is never
built; this measures the wall time, which depends on the machine: say the load). The job's model
is a small GPT-2 from a local config folder, so building it would cost what a real model costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _notes import write_keeping_notes  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
AUTOPIPE = [sys.executable, "-m", "autopipe"]


def make_job(root: Path) -> Path:
    """A 2-stage job of a 4-layer GPT-2 (a local HF folder), planned evenly (no profile)."""
    from transformers import GPT2Config

    from autopipe.job.script import write_train_script
    from autopipe.job.settings import JobSettings

    GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=50257, n_positions=128).save_pretrained(root / "gpt2")
    job = root / "job"
    job.mkdir()
    write_train_script(job, JobSettings(model=str(root / "gpt2"), stages=2, microbatches=4, schedule="1f1b"))
    (job / "plan.json").write_text(json.dumps({"boundaries": [0, 3, 6]}))
    return job


def cases(job: Path) -> dict[str, list[str]]:
    train = [sys.executable, str(job / "train.py")]
    run = [*AUTOPIPE, "run", str(job)]
    convert = [*AUTOPIPE, "convert", str(job.parent / "gpt2"), "--stages", "2"]
    return {
        "train.py --resume (nothing to resume)": [*train, "--resume"],
        "train.py --data missing.bin": [*train, "--data", "missing.bin"],
        "train.py --stpes 3 (a misspelled flag)": [*train, "--stpes", "3"],
        "autopipe run --resume (nothing to resume)": [*run, "--resume"],
        "autopipe run --nproc-per-node 3 (2 stages)": [*run, "--nproc-per-node", "3"],
        "autopipe run --data missing.bin": [*run, "--data", "missing.bin"],
        "convert --out an existing job folder": [*convert, "--out", str(job)],
        "convert --data missing.bin": [*convert, "--out", str(job.parent / "new"), "--data", "missing.bin"],
    }


def time_to_error(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    took = time.perf_counter() - start
    if done.returncode != 1 or not done.stderr.strip().startswith("error:"):
        raise SystemExit(f"{' '.join(cmd)}: expected one error line, got exit {done.returncode}:\n{done.stderr[-1500:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        job = make_job(Path(tmp))
        load = os.getloadavg()[0]
        rows = {}
        for name, cmd in cases(job).items():
            times = [time_to_error(cmd, job) for _ in range(args.runs)]
            rows[name] = {"median": statistics.median(times), "min": min(times), "max": max(times)}
            print(f"{name:48s} {rows[name]['median']:5.2f} s  ({rows[name]['min']:.2f}-{rows[name]['max']:.2f})")
        after = os.getloadavg()[0]
    text = ["# Time to the error line (bench/bench_fail_fast.py)", "",
            f"{args.runs} runs each, load {load:.1f} before and {after:.1f} after; seconds from the command's start "
            "to its exit with the one error line.", "", "| case | median s | min-max |", "| --- | --- | --- |"]
    text += [f"| {name} | {r['median']:.2f} | {r['min']:.2f}-{r['max']:.2f} |" for name, r in rows.items()]
    if not args.no_write:
        write_keeping_notes(RESULTS / "fail-fast.md", "\n".join(text) + "\n")
        (RESULTS / "fail-fast.json").write_text(json.dumps({"load": [load, after], "runs": args.runs, "cases": rows},
                                                           indent=1))


if __name__ == "__main__":
    main()
