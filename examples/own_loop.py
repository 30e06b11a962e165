"""Your own training loop over a pipeline: autopipe gives each rank its part, you keep the rest.

    autopipe convert examples/own_loop.py:build --stages 2 --out jobs/own   # plan it once
    torchrun --nproc-per-node 2 examples/own_loop.py --plan jobs/own/plan.json
    torchrun --nproc-per-node 2 examples/own_loop.py --plan 2              # or cut the layers evenly
    python examples/own_loop.py --plan 2                                  # every stage in this process

The model, the data set, the DataLoader, the loop and its hook are plain PyTorch: `autopipe.pipeline`
builds this rank's chunks of the model (on the meta device, then only its own tensors), the plan's
schedule and the optimizer over its parameters. Each step runs every micro-batch forward and
backward through the pipeline, then the gradients are clipped to their global norm and the
optimizer steps. Every rank reads the same batches: the first stage uses the inputs, the last one
the labels.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import autopipe
from autopipe.runtime import TrainConfig

VOCAB, SEQ, ROWS, MICROBATCHES = 64, 16, 8, 4  # ROWS per step, cut into MICROBATCHES


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        h = h + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]
        return h + self.mlp(h)


class TinyLM(nn.Module):
    """A small causal language model with a tied output head; returns the loss given labels."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: autopipe sums its gradient over the stages holding it

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.full((ids.shape[1], ids.shape[1]), float("-inf")), 1)
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h, mask)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))


def build(batch_size: int = ROWS // MICROBATCHES) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The factory: the model and one micro-batch of example inputs (what `convert` and `pipeline` trace)."""
    ids = torch.zeros(batch_size, SEQ, dtype=torch.long)
    return TinyLM(), (ids, ids)


def dataset(steps: int, seed: int = 0) -> TensorDataset:
    """Token windows of a repeating pattern the model can learn."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (steps * ROWS, 1), generator=g)
    return TensorDataset((start + torch.arange(SEQ)) % VOCAB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default="2", help="plan.json, or a number of stages to cut evenly")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log", default=None, help="write each step's loss and gradient norm to this JSON file")
    args = parser.parse_args()
    plan = int(args.plan) if args.plan.isdigit() else args.plan

    pipe = autopipe.pipeline(f"{__file__}:build", plan,
                             config=TrainConfig(steps=args.steps, microbatches=MICROBATCHES, lr=args.lr, grad_clip=1.0))
    loader = DataLoader(dataset(args.steps), batch_size=ROWS, shuffle=False)  # every rank the same batches
    history = []
    for step, (ids,) in enumerate(loader):
        pipe.forward_backward(ids, ids)  # the schedule: each micro-batch forward, then backward
        norm = pipe.clip_gradients()  # tied gradients summed, the global norm, the clip
        # a hook of your own goes here: the gradients of this rank's parameters are final
        stats = pipe.optimizer_step()  # AdamW's update and the LR schedule
        history.append({"step": stats.step, "loss": stats.loss, "grad_norm": norm})
        if pipe.env.rank == 0 and step % 5 == 0:
            print(f"step {stats.step:3d}  loss {stats.loss:.4f}  grad norm {norm:.3f}  on {pipe.env.pp_size} stage(s)")
    if args.log and pipe.env.rank == 0:
        with open(args.log, "w") as f:
            json.dump(history, f)
    pipe.close()


if __name__ == "__main__":
    main()
