"""A DeepSpeed user's own pipeline for GPT-2, cut by the file `autopipe export --to deepspeed` wrote.

The layers are what a DeepSpeed user writes by hand (a TiedLayerSpec for the embedding shared with the
output layer, one LayerSpec per block, the final norm); the exported ``parts_for`` maps them onto the
plan's stages and ``planned_pipeline_module`` builds DeepSpeed's PipelineModule with those parts. It
trains on the batches, initial weights and AdamW of autopipe's engines (no clipping) and writes the
per-step losses (rank 0) as JSON.

usage: torchrun --nproc-per-node=2 _ds_user_train.py MODEL_DIR DS_PIPELINE_PY STEPS LR MICRO ROWS SEQ OUT_JSON
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.pipe import LayerSpec, TiedLayerSpec  # noqa: E402
from torch import nn  # noqa: E402

from autopipe.runtime import TokenData, TrainConfig, build_reference, model_factory  # noqa: E402
from autopipe.runtime.training.optim import make_lr_scheduler, make_optimizer  # noqa: E402


class Wte(nn.Module):
    """The token embedding, shared by the first layer and the output layer (DeepSpeed ties it)."""

    def __init__(self, wte: nn.Module) -> None:
        super().__init__()
        self.wte = wte


def embed(mod: Wte, ids: torch.Tensor) -> torch.Tensor:
    return mod.wte(ids)


def head(mod: Wte, h: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(h, mod.wte.weight)


class Positions(nn.Module):
    def __init__(self, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wpe, self.drop = wpe, drop

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(h + self.wpe(torch.arange(h.shape[1], device=h.device)))


class Block(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.shape[1]
        mask = torch.full((t, t), torch.finfo(h.dtype).min, device=h.device).triu(1)[None, None]
        out = self.block(h, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out


class Run(nn.Module):
    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self.mod = mod

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mod(h)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """GPT-2's own causal LM loss: predict token t + 1 from position t."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def main() -> None:
    model_dir, ds_file, steps, lr, micro, rows, seq, out = sys.argv[1:9]
    steps, lr, micro, rows, seq = int(steps), float(lr), int(micro), int(rows), int(seq)
    spec = importlib.util.spec_from_file_location("ds_pipeline", ds_file)
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    deepspeed.init_distributed(dist_backend="gloo")
    source = model_factory(model_dir, batch_size=rows, seq_len=seq)
    model = build_reference(source.factory, seed=0)  # the weights autopipe's engines start from
    tr = model.transformer
    layers = [TiedLayerSpec("embed", Wte, tr.wte, forward_fn=embed, tied_weight_attr=["wte.weight"]),
              LayerSpec(Positions, tr.wpe, tr.drop), *[LayerSpec(Block, b) for b in tr.h], LayerSpec(Run, tr.ln_f),
              TiedLayerSpec("embed", Wte, tr.wte, forward_fn=head, tied_weight_attr=["wte.weight"])]  # fmt: skip
    names = ["transformer.wte", ["transformer.wpe", "transformer.drop"], *[f"transformer.h.{i}" for i in range(len(tr.h))],
             "transformer.ln_f", "lm_head"]  # fmt: skip
    parts = ds.parts_for(ds.STAGE_MODULES, names)
    net = ds.planned_pipeline_module(layers, parts, num_stages=ds.NUM_STAGES, loss_fn=loss_fn)
    config = TrainConfig(steps=steps, microbatches=micro, lr=lr, grad_clip=0.0, seed=0)
    params = dict(net.named_parameters())
    opt = make_optimizer(params, config)
    cfg = {**ds.DS_CONFIG, "gradient_clipping": 0.0, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    assert cfg["train_micro_batch_size_per_gpu"] == rows and cfg["gradient_accumulation_steps"] == micro
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=opt, lr_scheduler=make_lr_scheduler(opt, config), config=cfg)
    data = TokenData(None, vocab_size=source.vocab_size, seq_len=seq, seed=0)
    losses = []
    for step in range(steps):
        args, kwargs = source.batch(data.batch(step, rows * micro), rows * micro, step=step)
        ids, labels = args[0], kwargs.get("labels", args[0])
        batches = list(zip(ids.chunk(micro), labels.chunk(micro)))
        losses.append(float(engine.train_batch(data_iter=iter(batches))))
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"parts": list(net.parts), "losses": losses}, f)  # what DeepSpeed cut at
    # leave together: a rank whose interpreter exits while gloo's threads still run for its peer
    # aborts ("terminate called without an active exception", exit -6; seen once in CI)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
