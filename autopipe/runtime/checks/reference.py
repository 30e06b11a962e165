"""Plain single-process training of the original model: what the pipeline must reproduce.

Same weights (``build_reference``), same micro-batches, same loss, same clipping, same AdamW and LR
schedule as the pipelined ``Trainer``; ``--verify`` and the tests compare the two.

With dropout (or any random op) on, give ``layer_entries`` (``seq.layer_entries``): the model's own
forward is then seeded where each flattened layer starts, per micro-batch, as the pipeline seeds
that layer (``autopipe.runtime.checks.untouched.seeded_like_pipeline``), so both draw the same masks.
``SequenceModel`` (the flattened model run whole in this process) is the other way, for tests of
the runtime that take the layers as given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..data.batches import split_batch
from ..data.losses import model_loss
from ..process.distenv import to_device
from ..training.grads import clip_grads_
from ..training.optim import LossScaler, TrainConfig, make_lr_scheduler, make_optimizer

__all__ = ["ReferenceTrainer", "SequenceModel", "unique_parameters"]


class SequenceModel:
    """The whole flattened model as one chunk in this process, called like the model itself.

    Its parameters are the model's own, under the model's names (``named_parameters``,
    ``get_parameter``), so it stands in for the model in :class:`ReferenceTrainer`.

    Example:
        >>> from autopipe.runtime.stage.build import build_reference
        >>> from autopipe.runtime.data.losses import make_loss
        >>> def make_model():
        ...     return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> x = torch.randn(8, 8)
        >>> ref = SequenceModel.build_from(make_model, (x[:2],), {}, seed=0)  # one micro-batch: 2 rows
        >>> torch.allclose(ref(x[:2]), build_reference(make_model, seed=0)(x[:2]))  # the model's outputs, same weights
        True
        >>> trainer = ReferenceTrainer(ref, TrainConfig(microbatches=4), loss_fn=make_loss("mse"))
        >>> loss = trainer.step((x,), {}, torch.randn(8, 1))  # 4 micro-batches of 2 rows, one AdamW step
    """

    def __init__(self, build: Any) -> None:
        self.build = build
        (self.chunk,) = build.chunks

    @classmethod
    def build_from(cls, model_fn: Callable[[], nn.Module], args: Sequence[Any], kwargs: Mapping[str, Any] | None, *,
                   seed: int = 0, weights: str | None = None, device: torch.device | str = "cpu") -> "SequenceModel":
        from ..stage.build import build_stage

        return cls(build_stage(model_fn, args, dict(kwargs or {}), 1, pp_rank=0, pp_size=1, seed=seed,
                               weights=weights, device=device))

    def start_step(self, seeds: Any) -> None:
        self.chunk.start_step(seeds)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:
        return self.build.model.named_parameters(*args, **kwargs)

    def parameters(self) -> Any:
        return self.build.model.parameters()

    def get_parameter(self, name: str) -> nn.Parameter:
        return self.build.model.get_parameter(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        packed = self.build.seq.pack_inputs(args, kwargs)
        return self.build.seq.unpack_outputs(self.chunk(*packed))


def unique_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Each parameter object once, under its first name."""
    out: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p
    return out


class ReferenceTrainer:
    """Trains the whole model in this process, micro-batch by micro-batch (no pipeline)."""

    def __init__(
        self,
        model: nn.Module,
        config: TrainConfig,
        *,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        layer_entries: list[tuple[str, int] | None] | None = None,
    ) -> None:
        self.model = model
        self.layer_entries = layer_entries
        self.config = config
        self.loss_fn = loss_fn
        self.params = unique_parameters(model)
        self.optimizer = make_optimizer(self.params, config)
        self.scheduler = make_lr_scheduler(self.optimizer, config)
        self.scaler = LossScaler(config.dtype == "fp16", config.loss_scale)
        self.last_grad_norm = float("nan")  # the global norm of the last step's gradients, before clipping
        self.step_count = 0

    def forward_backward(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, target: Any = None, *, microbatches: int | None = None
    ) -> float:
        """Gradients of the mean micro-batch loss (left in ``.grad``); returns that loss."""
        m = microbatches or self.config.microbatches
        device = next(self.model.parameters()).device
        args, kwargs, target = to_device((tuple(args), dict(kwargs or {}), target), device)
        targets = list(target.chunk(m)) if isinstance(target, torch.Tensor) else [None] * m
        total = 0.0
        dtype = self.config.autocast_dtype
        from ..stage.build import MicrobatchSeeds
        from .untouched import seeded_like_pipeline

        seeds = MicrobatchSeeds(self.config.seed, self.step_count, 0)
        if isinstance(self.model, SequenceModel):
            self.model.start_step(seeds)
        entries = self.layer_entries
        with seeded_like_pipeline(self.model, entries, seeds) if entries else contextlib.nullcontext():
            for (a, k), t in zip(split_batch(args, kwargs, m), targets):
                with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    out = self.model(*a, **k)
                loss = model_loss(out) if self.loss_fn is None else self.loss_fn(out, t)
                (loss * self.scaler.scale / m).backward()
                total += float(loss.detach())
        if self.scaler.enabled:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.div_(self.scaler.scale)
        return total / m

    def step(
        self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, target: Any = None, *, microbatches: int | None = None
    ) -> float:
        loss = self.forward_backward(args, kwargs, target, microbatches=microbatches)
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        zero = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else "cpu")
        norm = float(torch.sqrt(sum((g.double().pow(2).sum() for g in grads), zero)))
        self.last_grad_norm = norm
        if finite:
            clip_grads_([p for p in self.params.values() if p.grad is not None], norm, self.config.grad_clip)
            self.optimizer.step()
            self.scheduler.step()  # as the Trainer: a skipped fp16 step is no step of the LR schedule
        self.scaler.update(finite)
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        return loss
