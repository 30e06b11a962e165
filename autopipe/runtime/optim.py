"""Training settings, AdamW with a warmup + cosine learning rate, and fp16 loss scaling.

The pipelined trainer and the unpipelined reference both build their optimizer here, so they make
the same decisions (which tensors get weight decay, the LR at each step) and stay comparable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ..choices import PRECISIONS, ZERO_STAGES
from ..errors import AutopipeError

__all__ = ["LossScaler", "TrainConfig", "make_lr_scheduler", "make_optimizer", "param_groups", "preallocate_"]



@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings shared by every rank (and by the reference)."""

    steps: int = 100
    microbatches: int = 4
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # the cosine decays to lr · min_lr_ratio at the last step
    warmup: int = 0  # steps of linear warmup
    weight_decay: float = 0.1  # applied to matrices only (not to biases, norms' gains)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    grad_clip: float = 1.0  # global gradient-norm clip; 0 turns it off
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (autocast; master weights stay fp32)
    loss_scale: float = 2.0**16  # initial fp16 loss scale
    seed: int = 0
    zero: int = 0  # ZeRO stage over data-parallel replicas (autopipe.runtime.zero): 0 1 2 3

    def __post_init__(self) -> None:
        if self.dtype not in PRECISIONS:
            raise AutopipeError(f"dtype must be one of {list(PRECISIONS)}, got {self.dtype!r}.")
        if self.microbatches < 1 or self.steps < 0:
            raise AutopipeError(
                f"microbatches ({self.microbatches}) must be >= 1 and steps ({self.steps}) >= 0."
            )
        if self.zero not in ZERO_STAGES:
            raise AutopipeError(f"--zero {self.zero}: use 0 (replicate), 1 (shard optimizer state), 2 (and gradients) or 3 (and parameters).")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return None if self.dtype == "fp32" else getattr(torch, PRECISIONS[self.dtype])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def param_groups(params: Mapping[str, nn.Parameter], config: TrainConfig) -> list[dict[str, Any]]:
    """AdamW's groups over ``params`` (name -> parameter): decay on tensors of 2+ dims, in name order."""
    decay = [p for _, p in sorted(params.items()) if p.requires_grad and p.dim() >= 2]
    no_decay = [p for _, p in sorted(params.items()) if p.requires_grad and p.dim() < 2]
    # no empty group: DeepSpeed drops them from the optimizer after the LR schedule has counted them
    # (a stage holding only matrices then failed at its first step); torch ignores them either way
    groups = [
        g
        for g in ({"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ] or [{"params": [], "weight_decay": 0.0}]
    return groups


def make_optimizer(
    params: Mapping[str, nn.Parameter], config: TrainConfig, *, cls: type[torch.optim.AdamW] = torch.optim.AdamW
) -> torch.optim.AdamW:
    """AdamW over ``params`` (name -> parameter, each object once), decay on tensors of 2+ dims.

    ``foreach=True``: one multi-tensor kernel per step and group, not one per tensor (on a GPU a
    rank's thousands of small tensors otherwise cost a launch each). Its sums group tensors
    differently from the reference's, which differs in the last bits only (well inside the
    tests' 1e-5).
    """
    return cls(param_groups(params, config), lr=config.lr, betas=config.betas, eps=config.eps, foreach=True)


def preallocate_(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its gradient and its Adam(W) state now, as zeros, once for the whole run.

    Why: on a CPU rank the heap never shrinks (``keep_freed_memory``), and gradients made at each
    step's first backward and optimizer state made at the first update land in the holes the
    activations left, so the heap grew step after step: 60 MiB more than the tensors on a 280 MiB
    GPT-2 rank, measured. Allocated first and kept, they sit together and the activations reuse
    one region (the same holds for CUDA's caching allocator). Zero state is exactly what the
    optimizer would create itself; gradients start at zero and accumulate, as from None.

    The state's layout is taken from the optimizer itself: a one-element twin with the same
    settings takes one step, and each of its state tensors is created as zeros shaped like the
    real parameter (or like the twin's, for scalars such as ``step``). Only Adam and AdamW, whose
    fresh state is all zeros; other optimizers keep their lazy state.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) and not isinstance(optimizer, torch.optim.AdamW):
        return
    layouts: dict[tuple[int, torch.dtype, torch.device], dict[str, Any]] = {}
    for index, group in enumerate(optimizer.param_groups):
        settings = {k: v for k, v in group.items() if k != "params"}
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p):
                continue
            key = (index, p.dtype, p.device)
            if key not in layouts:
                twin = nn.Parameter(torch.zeros(1, dtype=p.dtype, device=p.device))
                twin.grad = torch.zeros_like(twin)
                probe = type(optimizer)([{"params": [twin], **settings}])
                probe.step()
                layouts[key] = dict(probe.state[twin])
            optimizer.state[p] = {
                k: (torch.zeros_like(p) if v.dim() > 0 else torch.zeros_like(v)) if isinstance(v, torch.Tensor) else v
                for k, v in layouts[key].items()
            }


def lr_factor(step: int, config: TrainConfig) -> float:
    """LR multiplier at ``step`` (0-based): linear warmup, then cosine down to ``min_lr_ratio``."""
    if config.warmup and step < config.warmup:
        return (step + 1) / config.warmup
    span = max(1, config.steps - config.warmup)
    progress = min(1.0, (step - config.warmup) / span)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_lr_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, config))


class LossScaler:
    """Dynamic loss scaling for fp16: multiply the loss, unscale the gradients, skip a step whose
    gradients overflowed (on any rank) and halve the scale; double it after ``growth_interval``
    good steps. A no-op (scale 1) for fp32 and bf16."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = float(init_scale) if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0

    def update(self, finite: bool) -> None:
        if not self.enabled:
            return
        if finite:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2.0
        else:
            self.scale = max(1.0, self.scale / 2.0)
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
