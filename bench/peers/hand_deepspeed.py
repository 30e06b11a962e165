"""A bare DeepSpeed pipeline script: the ``PipelineModule`` a user writes by hand from DeepSpeed's tutorial.

    torchrun --nproc-per-node S hand_deepspeed.py MODEL_DIR --partition parameters --steps 10
    torchrun --nproc-per-node S hand_deepspeed.py MODEL_DIR --parts 0,6,11 --steps 10

Each rank builds the whole model (autopipe's seeded weights, so every method starts equal) and lists
its layers (``layers.user_layers``, passed built, so ``type:Block`` finds them by class); GPT-2's
embedding and head share a ``TiedLayerSpec``, as the tutorial ties them. DeepSpeed cuts them by ``--partition`` (its
``partition_method``: ``parameters``, ``uniform``, ``type:Block``) or at ``--parts`` (autopipe's cut,
for the same-cut comparison). The ds_config is the tutorial's: AdamW (DeepSpeed's own), the batch as
micro-batches, ``gradient_clipping`` as given (DeepSpeed's own clip). No autopipe code runs in the
step; the batches are autopipe's synthetic tokens (the same for every method).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule, TiedLayerSpec
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layers import Block, Embed, Head, Norm, loss_fn, user_layers
from record import Recorder


class Ready(nn.Module):
    """A layer built already (LayerSpec builds its module from arguments: these are the built one)."""

    def __new__(cls, module: nn.Module) -> nn.Module:  # type: ignore[misc]
        return module


def _embed(mod: Embed, ids: torch.Tensor) -> torch.Tensor:
    return mod(ids)


def _head(mod: Embed, h: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(h, mod.tokens.weight)


def specs(model: nn.Module) -> list:
    """The tutorial's layer list: the built layers, with tied ends as one TiedLayerSpec (GPT-2)."""
    layers = user_layers(model)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: list = []
    for i, layer in enumerate(layers):
        if tied and i == 0:
            out.append(TiedLayerSpec("embed", Ready, layer, forward_fn=_embed, tied_weight_attr=["tokens.weight"]))
        elif tied and i == len(layers) - 1:
            out.append(TiedLayerSpec("embed", Ready, layers[0], forward_fn=_head, tied_weight_attr=["tokens.weight"]))
        else:
            out.append(layer)
    assert {type(x) for x in layers} <= {Embed, Block, Norm, Head}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--partition", default="parameters", help="DeepSpeed's partition_method")
    p.add_argument("--parts", default=None, help="explicit cut (layer indices, as autopipe's plan boundaries)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--clip", type=float, default=1.0)
    args = p.parse_args()
    rec = Recorder()
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()

    from autopipe.runtime import (  # the weights and batches only
        TokenData,
        build_reference,
        model_factory,
    )

    source = model_factory(args.model, batch_size=args.rows, seq_len=args.seq)
    model = build_reference(source.factory, seed=0)
    if args.parts:  # autopipe's cut, for the same-cut comparison
        net = _with_parts(model, [int(x) for x in args.parts.split(",")])
    else:
        net = PipelineModule(specs(model), num_stages=world, loss_fn=loss_fn, partition_method=args.partition,
                             activation_checkpoint_interval=0)  # fmt: skip
    cfg = {
        "train_micro_batch_size_per_gpu": args.rows,
        "gradient_accumulation_steps": args.microbatches,
        "train_batch_size": args.rows * args.microbatches,
        "gradient_clipping": args.clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[q for q in net.parameters() if q.requires_grad],
                                           config=cfg)  # fmt: skip
    rec.extra["parts"] = [int(x) for x in net.parts]
    data = TokenData(None, vocab_size=source.vocab_size, seq_len=args.seq, seed=0)
    rows = args.rows * args.microbatches
    rec.start()
    for step in range(args.steps):
        ids = data.batch(step, rows)
        loss = engine.train_batch(data_iter=iter([(x, x) for x in ids.chunk(args.microbatches)]))
        rec.step(float(loss) if engine.is_last_stage() else None)
    dist.barrier()
    if dist.get_rank() == 0 and os.environ.get("BENCH_RECORD_DIR"):
        with open(os.path.join(os.environ["BENCH_RECORD_DIR"], "parts.json"), "w") as f:
            json.dump([int(x) for x in net.parts], f)
    dist.barrier()
    dist.destroy_process_group()  # exiting with gloo's threads alive can abort a rank


def _with_parts(model: nn.Module, parts: list[int]) -> PipelineModule:
    """A PipelineModule cut at ``parts`` (DeepSpeed has no partition_method for a given cut: its
    ``_partition_layers`` is replaced, as users of fixed cuts do)."""

    class Fixed(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = parts
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1])

    return Fixed(specs(model), num_stages=len(parts) - 1, loss_fn=loss_fn, activation_checkpoint_interval=0)


if __name__ == "__main__":
    main()
