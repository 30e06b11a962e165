"""A CNN classifier trained pipelined on 2 processes on real images, with its held-out accuracy.

The data set is scikit-learn's handwritten digits (1,797 8x8 images, shipped inside the package, so
nothing is downloaded). The factory gives autopipe the model, its example input and its training
data; the model returns logits, so the job trains it with ``--loss cross_entropy``:

    autopipe convert examples/digits_cnn.py:build --stages 2 --batch-size 16 --loss cross_entropy --eval-data test.npz
    autopipe run jobs/digits_cnn-build --steps 150 --lr 3e-3 --eval-every 50 --export trained/

The job evaluates on the 297 images it never trains on (``test.npz``, saved by this script) every
50 steps and at the end: loss and accuracy, forward-only through the pipeline. Run as a script it
does the same from Python, then loads the exported weights into the plain model and measures its
accuracy on those images itself, which equals the job's last evaluation:

    python examples/digits_cnn.py [--steps 150] [--workdir DIR]
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

import numpy as np
import torch
from torch import nn

__all__ = ["DigitsCNN", "build", "digits"]

HELD_OUT = 297  # the last images, after a fixed shuffle: never trained on


class DigitsCNN(nn.Module):
    """Two convolutions and two linear layers: 8x8 grey images in, 10 class logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))  # 4x4
        self.fc = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.1))
        self.out = nn.Linear(64, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # (B, 1, 8, 8) -> (B, 10)
        return self.out(self.fc(self.conv2(self.conv1(images))))


def digits(split: str) -> dict[str, np.ndarray]:
    """The digits as ``{"x": (N, 1, 8, 8) float32 in [0, 1], "y": (N,) int64}``, ``train`` or ``test``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    order = np.random.default_rng(0).permutation(len(d.target))
    x = (d.images[order] / 16.0).astype(np.float32)[:, None]
    y = d.target[order].astype(np.int64)
    cut = len(y) - HELD_OUT
    return {"x": x[:cut], "y": y[:cut]} if split == "train" else {"x": x[cut:], "y": y[cut:]}


def build(batch_size: int = 16) -> dict:
    """Factory for `autopipe convert examples/digits_cnn.py:build`: the model, one example micro-batch,
    and the training images (a function: the factory itself runs on the meta device, where arrays made
    with torch would hold no values)."""
    return {"model": DigitsCNN(), "args": (torch.zeros(batch_size, 1, 8, 8),), "data": lambda: digits("train")}


def accuracy(weights: Path, rows: int | None = None) -> float:
    """Held-out accuracy of the plain model with the trained weights (on the first ``rows`` images)."""
    from safetensors.torch import load_file

    model = DigitsCNN()
    model.load_state_dict(load_file(str(weights)))
    model.eval()
    test = digits("test")
    x, y = test["x"][:rows], test["y"][:rows]
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(-1).numpy()
    return float((predicted == y).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--workdir", type=Path, default=None)
    opts = parser.parse_args()
    work = opts.workdir or Path(tempfile.mkdtemp(prefix="autopipe-digits-"))
    from autopipe.job.converter import convert

    work.mkdir(parents=True, exist_ok=True)
    np.savez(work / "test.npz", **digits("test"))  # the held-out images the job evaluates on
    result = convert(f"{Path(__file__).resolve()}:build", stages=2, batch_size=16, microbatches=4, loss="cross_entropy",
                     eval_data=work / "test.npz", out=work / "job", repeats=2, progress=False)
    print(f"{result.plan.num_layers} layers -> 2 stages, cuts before layers {list(result.plan.boundaries[1:-1])} "
          f"(schedule {result.plan.schedule})")
    every = max(1, opts.steps // 2)
    command = shlex.split(result.job.launch) + ["--steps", str(opts.steps), "--lr", "3e-3", "--eval-every", str(every),
                                                "--export", str(work / "trained"), "--log-json", str(work / "log.json")]
    print("$", shlex.join(command))
    subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
    evaluated = [r for r in map(json.loads, (work / "log.json").read_text().splitlines()) if "eval_accuracy" in r]
    print("the job's evaluations: " + ", ".join(f"step {r['step']} accuracy {r['eval_accuracy']:.1%}" for r in evaluated))
    rows = HELD_OUT // (16 * 4) * (16 * 4)  # whole evaluation batches of 4 micro-batches of 16
    acc = accuracy(work / "trained" / "model.safetensors", rows=rows)
    chance = 0.1
    print(f"held-out accuracy: {acc:.1%} on the job's {rows} evaluation images, never trained on "
          f"(chance {chance:.0%}; the job's last evaluation: {evaluated[-1]['eval_accuracy']:.1%})")


if __name__ == "__main__":
    sys.exit(main())
