"""One rank of the torchtitan export test: build the parts torchtitan would build from the exported
module lists (tests/_titan_split.py), run one step of torch.distributed.pipelining's schedule on
gloo, and save this rank's per-micro-batch losses and gradients (by their names in the whole model).

usage: torchrun --nproc-per-node=P _titan_run.py PARTS.json SCHEDULE MICROBATCHES LAYERS OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from _titan_split import causal_lm_loss, llama_part, tiny_llama
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    ScheduleZBVZeroBubble,
    get_schedule_class,
)


def main() -> None:
    parts_path, schedule, m, layers, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    parts = json.loads(open(parts_path).read())
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tiny_llama(layers)
    ids = torch.randint(0, 96, (2 * m, 8), generator=torch.Generator().manual_seed(1))
    n = len(parts)
    cls = get_schedule_class(schedule)
    if cls is ScheduleZBVZeroBubble:  # torchtitan's "v" style: rank r holds parts r and n-1-r
        mine = [rank, n - 1 - rank]
    else:  # "loop" style: rank r holds parts r, r + pp, ...
        mine = list(range(rank, n, pp))
    chunks = {i: llama_part(model, parts[i]) for i in mine}
    stages = [PipelineStage(chunks[i], i, n, torch.device("cpu"), group=dist.group.WORLD) for i in mine]
    multi = issubclass(cls, PipelineScheduleMulti)
    sched = cls(stages if multi else stages[0], n_microbatches=m, loss_fn=causal_lm_loss)
    losses: list[torch.Tensor] = []
    first, last = 0 in mine, n - 1 in mine
    args = (ids,) if first else ()
    sched.step(*args, target=ids if last else None, losses=losses if last else None)
    grads = {name: p.grad.detach().clone() for c in chunks.values() for name, p in c.named_parameters() if p.grad is not None}
    held = sorted(name for c in chunks.values() for name, _ in c.named_parameters())
    torch.save({"losses": [float(x) for x in losses], "grads": grads, "held": held}, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
