"""Your own model, converted by name: `autopipe convert examples/my_model.py:build --stages 2`.

A factory is any function that returns the model and one micro-batch of example inputs. autopipe
calls it with ``batch_size`` and ``seq_len`` when it takes them (from --batch-size / --seq-len), so
the example inputs have the shape the job trains on. No base class, no layer list, no tuple packing:
a plain nn.Module whose forward returns the loss when it is given targets.

Run it as a script to see the same steps from Python:

    python examples/my_model.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["TinyMLPClassifier", "build"]


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyMLPClassifier(nn.Module):
    """Features in, class scores out; returns the cross-entropy loss when given labels."""

    def __init__(self, features: int = 32, width: int = 64, depth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)  # the loss is the model's output: the pipeline trains on it


def build(batch_size: int = 8) -> tuple[nn.Module, tuple[torch.Tensor], dict[str, torch.Tensor]]:
    """The factory autopipe calls: (model, example args, example kwargs) for one micro-batch."""
    model = TinyMLPClassifier()
    x = torch.randn(batch_size, 32)
    labels = torch.randint(0, 10, (batch_size,))
    return model, (x,), {"labels": labels}


if __name__ == "__main__":
    import autopipe

    model, args, kwargs = build()
    seq = autopipe.flatten(model, args, kwargs)
    print(f"{len(seq.layers)} layers:", ", ".join(info.name for info in seq.infos))
    prof = autopipe.profile(seq, args, kwargs, repeats=3, warmup=1, progress=False)
    plan = autopipe.partition(prof, stages=2)
    print("cut before layer", plan.boundaries[1], "| stage times (ms):",
          ", ".join(f"{t * 1e3:.3f}" for t in plan.stage_times))
    first, second = seq.split(plan)
    loss = second(first(*args, **kwargs))  # the two stages, one after the other, are the model
    torch.testing.assert_close(loss, model(*args, **kwargs))
    print(f"two stages give the model's loss: {loss.item():.4f}")
