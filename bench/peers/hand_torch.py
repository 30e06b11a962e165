"""A bare torch.distributed.pipelining script: the pipeline a user writes by hand from torch's tutorial.

    torchrun --nproc-per-node S hand_torch.py MODEL_DIR --parts 0,6,11 --steps 10

Each rank builds the whole model (autopipe's seeded weights, so every method starts equal), keeps its
layers (``layers.user_layers``[parts[r]:parts[r+1]]) as one ``nn.Sequential``, and runs torch's own
``PipelineStage`` and ``Schedule1F1B``. After the schedule: the tied embedding's gradient summed
over its two holders (GPT-2), the global gradient norm (one all-reduce) and its clip, AdamW. No
autopipe code runs in the step; the batches are autopipe's synthetic tokens (the same for every method).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.profiler import record_function

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layers import loss_fn, param_groups, user_layers
from record import Recorder


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--parts", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--clip", type=float, default=1.0)
    args = p.parse_args()
    rec = Recorder()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = [int(x) for x in args.parts.split(",")]

    from autopipe.runtime import (  # the weights and batches only
        TokenData,
        build_reference,
        model_factory,
    )

    source = model_factory(args.model, batch_size=args.rows, seq_len=args.seq)
    model = build_reference(source.factory, seed=0)
    layers = user_layers(model)
    stage_module = nn.Sequential(*layers[parts[rank] : parts[rank + 1]])
    first, last = rank == 0, rank == world - 1
    # GPT-2's head uses the embedding's weight: each end keeps a copy, and the copies' gradients are summed
    tied = getattr(model.config, "tie_word_embeddings", False) and world > 1
    tie_group = dist.new_group([0, world - 1]) if tied else None
    params = [q for q in stage_module.parameters()]
    counted = [q for q in params if not (tied and last and q is layers[-1].head.weight)]
    opt = torch.optim.AdamW(param_groups(params), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, foreach=True)
    stage = PipelineStage(stage_module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, args.microbatches, loss_fn=loss_fn)
    data = TokenData(None, vocab_size=source.vocab_size, seq_len=args.seq, seed=0)
    rows = args.rows * args.microbatches
    rec.start()
    for step in range(args.steps):
        ids = data.batch(step, rows)
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(ids)
        elif last:
            schedule.step(target=ids, losses=losses)
        else:
            schedule.step()
        if tied and (first or last):  # (the ranges name the parts for bench_peers' breakdown; no cost unless profiled)
            with record_function("part: tied + dp reduce"):
                dist.all_reduce((layers[0] if first else layers[-1].head).weight.grad, group=tie_group)
        with record_function("part: grad norm/clip"):
            squares = torch.nn.utils.get_total_norm([q.grad for q in counted if q.grad is not None]) ** 2
            dist.all_reduce(squares)
        torch.nn.utils.clip_grads_with_norm_(params, args.clip, squares.sqrt())
        opt.step()
        opt.zero_grad()
        rec.step(torch.stack(losses).mean().item() if last else None)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
