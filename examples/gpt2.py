"""GPT-2 end to end: convert, read the plan, launch the generated train.py, watch the loss fall.

The same as these two commands (the README's quick start), from Python:

    autopipe convert gpt2 --stages 4
    torchrun --nproc-per-node 4 jobs/gpt2/train.py

By default this runs a small GPT-2 (4 layers, width 128, same architecture and tied embeddings) from
a local HuggingFace-style folder holding only its config.json, so it takes seconds on a CPU;
``--full`` converts the real 124M-parameter shape (``gpt2``, random weights, nothing downloaded).

    python examples/gpt2.py [--full] [--stages 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from autopipe.job.converter import convert

__all__ = ["small_gpt2_folder"]


def small_gpt2_folder(folder: Path) -> Path:
    """A HuggingFace model folder with a config only: autopipe builds it with random weights."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 1024, "n_positions": 256,
        "n_embd": 128, "n_layer": 4, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="GPT-2 124M instead of the small one")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--workdir", type=Path, default=None, help="where the job goes (default: a temp folder)")
    opts = parser.parse_args()
    work = opts.workdir or Path(tempfile.mkdtemp(prefix="autopipe-gpt2-"))
    model = "gpt2" if opts.full else str(small_gpt2_folder(work / "gpt2-small"))

    # 1. convert: trace, flatten, profile, partition, write the job folder
    result = convert(model, stages=opts.stages, seq_len=opts.seq_len, out=work / "job", repeats=3, progress=False)
    plan = result.plan
    print(f"{plan.num_layers} layers -> {plan.stages} stages, cuts before layers {list(plan.boundaries[1:-1])} "
          f"(schedule {plan.schedule}, chosen as the fastest predicted step)")
    for c in range(plan.num_chunks):  # a chunk per stage, or two under interleaved and zbv
        first = result.profile.layers[plan.boundaries[c]].name
        print(f"  chunk {c} on rank {plan.stage_ranks[c]}: from {first:28s} {plan.stage_times[c] * 1e3:8.2f} ms per micro-batch")
    print(f"predicted step {plan.step_time * 1e3:.1f} ms, bubble {plan.bubble_fraction:.0%}; "
          f"report: {result.job.job_dir / 'report.html'}")

    # 2. launch the generated script exactly as printed, for a few steps, and read its losses
    log = work / "losses.json"
    command = shlex.split(result.job.launch) + ["--steps", str(opts.steps), "--log-json", str(log)]
    print("$", shlex.join(command))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(command, check=True, env=env)
    losses = [row["loss"] for row in _read_log(log)]
    print("losses:", " ".join(f"{x:.3f}" for x in losses))
    print("loss fell" if losses and losses[-1] < losses[0] else "loss did not fall")


def _read_log(path: Path) -> list[dict]:
    """--log-json: one JSON object per step (a list, or one per line)."""
    text = path.read_text().strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


if __name__ == "__main__":
    sys.exit(main())
