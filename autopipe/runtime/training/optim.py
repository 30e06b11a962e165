"""Training settings, the optimizer and its learning-rate schedule, and fp16 loss scaling.

The optimizer is the user's: torch's AdamW (decoupled weight decay, ``betas``), SGD (``momentum``,
L2 weight decay as torch applies it) or Adafactor (factored second moments: a matrix keeps a row and
a column of statistics, not a copy of itself), weight decay on matrices only. The learning rate
warms up linearly for ``warmup`` steps, then follows ``lr_schedule``: ``cosine`` or ``linear`` down
to ``lr · min_lr_ratio`` at the last step, or ``constant``.

The pipelined trainer, the DeepSpeed one and the unpipelined reference all build their optimizer
here, so they make the same decisions (which tensors get weight decay, the LR at each step) and
stay comparable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from ...choices import FUSED_ADAM_DEVICES, PRECISIONS, ZERO_STAGES
from ...errors import AutopipeError

__all__ = ["LR_SCHEDULES", "LossScaler", "OPTIMIZERS", "TrainConfig", "check_zero", "describe_optimizer", "lr_factor", "make_lr_scheduler", "make_optimizer", "optimizer_class", "optimizer_options", "param_groups", "preallocate_"]

# --optimizer -> torch's class (by name: Adafactor needs torch >= 2.5)
OPTIMIZERS = {"adamw": "AdamW", "sgd": "SGD", "adafactor": "Adafactor"}
LR_SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings shared by every rank (and by the reference)."""

    steps: int = 100
    microbatches: int = 4
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine and linear decay to lr · min_lr_ratio at the last step
    warmup: int = 0  # steps of linear warmup
    weight_decay: float = 0.1  # applied to matrices only (not to biases, norms' gains)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's
    eps: float = 1e-8  # AdamW's
    grad_clip: float = 1.0  # global gradient-norm clip; 0 turns it off
    dtype: str = "fp32"  # fp32 | bf16 | fp16 (autocast; master weights stay fp32)
    loss_scale: float = 2.0**16  # initial fp16 loss scale
    seed: int = 0
    zero: int = 0  # ZeRO stage over data-parallel replicas (autopipe.runtime.torch_engine.zero): 0 1 2 3
    optimizer: str = "adamw"  # one of OPTIMIZERS
    lr_schedule: str = "cosine"  # one of LR_SCHEDULES, after the warmup
    momentum: float = 0.9  # SGD's

    def __post_init__(self) -> None:
        if self.dtype not in PRECISIONS:
            raise AutopipeError(f"dtype must be one of {list(PRECISIONS)}, got {self.dtype!r}.")
        if self.microbatches < 1 or self.steps < 0:
            raise AutopipeError(
                f"microbatches ({self.microbatches}) must be >= 1 and steps ({self.steps}) >= 0."
            )
        if self.zero not in ZERO_STAGES:
            raise AutopipeError(f"--zero {self.zero}: use 0 (replicate), 1 (shard optimizer state), 2 (and gradients) or 3 (and parameters).")
        object.__setattr__(self, "optimizer", str(self.optimizer).lower())
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.optimizer not in OPTIMIZERS:
            raise AutopipeError(f"--optimizer {self.optimizer}: use {', '.join(OPTIMIZERS)}.")
        if self.lr_schedule not in LR_SCHEDULES:
            raise AutopipeError(f"--lr-schedule {self.lr_schedule}: use {', '.join(LR_SCHEDULES)}.")
        if not (self.lr > 0 and self.weight_decay >= 0 and self.grad_clip >= 0 and self.warmup >= 0
                and 0 <= self.min_lr_ratio <= 1 and 0 <= self.momentum < 1):
            raise AutopipeError(
                f"--lr {self.lr} must be > 0, --weight-decay {self.weight_decay}, --grad-clip {self.grad_clip} and "
                f"--warmup {self.warmup} >= 0, --min-lr-ratio {self.min_lr_ratio} in [0, 1], --momentum "
                f"{self.momentum} in [0, 1)."
            )
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise AutopipeError(f"--betas {','.join(map(str, self.betas))}: give two numbers in [0, 1), like 0.9,0.95.")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return None if self.dtype == "fp32" else getattr(torch, PRECISIONS[self.dtype])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def param_groups(params: Mapping[str, nn.Parameter], config: TrainConfig) -> list[dict[str, Any]]:
    """The optimizer's groups over ``params`` (name -> parameter): decay on tensors of 2+ dims, in name order."""
    decay = [p for _, p in sorted(params.items()) if p.requires_grad and p.dim() >= 2]
    no_decay = [p for _, p in sorted(params.items()) if p.requires_grad and p.dim() < 2]
    # no empty group: DeepSpeed drops them from the optimizer after the LR schedule has counted them
    # (a stage holding only matrices then failed at its first step); torch ignores them either way
    # a group holds DTensors (replicate, FSDP2) or plain tensors, never both: the fused and foreach
    # kernels refuse a mix, which expert parallelism makes (its expert slices stay plain beside
    # replicate's DTensors); without a mix the groups are the two above
    groups = [
        {"params": same, "weight_decay": wd}
        for ps, wd in ((decay, config.weight_decay), (no_decay, 0.0))
        for same in _plain_then_dtensors(ps)
        if same
    ] or [{"params": [], "weight_decay": 0.0}]
    return groups


def _plain_then_dtensors(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    from torch.distributed.tensor import DTensor

    dt = [p for p in params if isinstance(p, DTensor)]
    return [params] if not dt or len(dt) == len(params) else [[p for p in params if not isinstance(p, DTensor)], dt]


def optimizer_class(config: TrainConfig) -> type[torch.optim.Optimizer]:
    """torch's class for ``config.optimizer``."""
    cls = getattr(torch.optim, OPTIMIZERS[config.optimizer], None)
    if cls is None:
        raise AutopipeError(f"--optimizer {config.optimizer} needs torch.optim.{OPTIMIZERS[config.optimizer]} "
                            f"(torch >= 2.5; this is {torch.__version__}); use adamw or sgd.")
    return cls


def optimizer_options(config: TrainConfig, device: torch.device | str | None = None) -> dict[str, Any]:
    """The keyword settings ``optimizer_class(config)`` takes (weight decay is per group) for
    parameters on ``device``.

    AdamW on a CPU or a GPU (``choices.FUSED_ADAM_DEVICES``): ``fused=True``, torch's fused kernel,
    one pass over each parameter with its gradient and state and no temporaries. Measured on this
    2-core machine, one thread, a 2.9M-parameter GPT-2 stage: 6-7 ms a step against foreach's
    23-30 ms (DeepSpeed's own FusedAdam, which its users get from ``"type": "AdamW"``: 6-7 ms), and
    no state-sized temporary (foreach's square root of every ``exp_avg_sq``: +256 MiB peak on 256
    MiB of parameters). Its updates differ from foreach's in the last bits (3.7e-9 after 5 steps).
    Elsewhere, and for the other optimizers, ``foreach=True``: one multi-tensor kernel per step and
    group, not one per tensor (on a GPU a rank's thousands of small tensors otherwise cost a launch
    each); its sums group tensors differently from a per-tensor loop, which differs in the last bits.
    """
    if config.optimizer == "adamw":
        kind = torch.device(device).type if device is not None else None
        fast = {"fused": True} if kind in FUSED_ADAM_DEVICES else {"foreach": True}
        return {"lr": config.lr, "betas": config.betas, "eps": config.eps, **fast}
    if config.optimizer == "sgd":
        return {"lr": config.lr, "momentum": config.momentum, "foreach": True}
    return {"lr": config.lr, "foreach": True}  # Adafactor: torch's defaults for its decay and clipping


def describe_optimizer(config: TrainConfig) -> str:
    """The optimizer and schedule in a few words, for the run's first line.

    >>> describe_optimizer(TrainConfig(lr=3e-4, warmup=10))
    'adamw lr 3e-04 (betas 0.9,0.95, decay 0.1), warmup 10 then cosine to 3e-05, clip 1'
    """
    c = config
    detail = {"adamw": f"betas {c.betas[0]:g},{c.betas[1]:g}, ", "sgd": f"momentum {c.momentum:g}, "}.get(c.optimizer, "")
    warm = f"warmup {c.warmup} then " if c.warmup else ""
    shape = "constant" if c.lr_schedule == "constant" else f"{c.lr_schedule} to {c.lr * c.min_lr_ratio:.0e}"
    clip = f"clip {c.grad_clip:g}" if c.grad_clip else "no clip"
    return f"{c.optimizer} lr {c.lr:.0e} ({detail}decay {c.weight_decay:g}), {warm}{shape}, {clip}"


def make_optimizer(
    params: Mapping[str, nn.Parameter], config: TrainConfig, *, cls: type[torch.optim.Optimizer] | None = None
) -> torch.optim.Optimizer:
    """The configured optimizer over ``params`` (name -> parameter, each object once), decay on
    tensors of 2+ dims. ``cls``: a subclass of that optimizer's class to build instead (DeepSpeed's
    engine gets one that clips first)."""
    device = next((p.device for p in params.values()), None)
    return (cls or optimizer_class(config))(param_groups(params, config), **optimizer_options(config, device))


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
    """LR multiplier at ``step`` (0-based): linear warmup, then ``config.lr_schedule``.

    >>> [round(lr_factor(s, TrainConfig(steps=4, warmup=2, lr_schedule="linear", min_lr_ratio=0.0)), 2) for s in range(5)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """
    if config.warmup and step < config.warmup:
        return (step + 1) / config.warmup
    if config.lr_schedule == "constant":
        return 1.0
    span = max(1, config.steps - config.warmup)
    progress = min(1.0, (step - config.warmup) / span)
    shape = 1 - progress if config.lr_schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * shape


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


def check_zero(zero: Any) -> int:
    """``zero`` as an int in 0..3, or a one-line error."""
    if str(zero).strip() not in {str(s) for s in ZERO_STAGES}:
        raise AutopipeError(f"--zero {zero}: use 0 (replicate), 1 (shard optimizer state), 2 (and gradients) or 3 (and parameters).")
    return int(zero)
