"""The model a training job rebuilds on every rank: a factory plus one micro-batch of example inputs.

``model_factory("gpt2", batch_size=2, seq_len=128)`` wraps ``autopipe.models.load_model`` (built-in
names, local HF folders, ``module:function`` factories) as a zero-argument factory that builds on
whatever device is current, so the runtime can build it on meta (every rank), on the CPU (the
reference), or not at all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["ModelSource", "model_factory"]


@dataclass
class ModelSource:
    """How to build the model and what its inputs look like (one micro-batch, on meta)."""

    name: str
    factory: Callable[[], nn.Module]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    task: str = "custom"
    vocab_size: int = 0
    weights: str | None = None  # a HF folder's safetensors, when it has them

    def batch(self, tokens: torch.Tensor | None, rows: int, *, step: int = 0, seed: int = 0) -> tuple[tuple, dict]:
        """The model's arguments for ``rows`` rows.

        Language models get ``tokens`` as input ids and labels (HF shifts labels itself). Other
        models get random tensors shaped like the example (integers below the vocabulary size, or
        0/1, floats standard normal, masks all true), seeded from ``(seed, step)``.
        """
        if tokens is not None and self.task in ("causal-lm", "masked-lm"):
            kwargs = dict(self.kwargs)
            if "labels" in kwargs:
                kwargs["labels"] = tokens
            return (tokens,), kwargs
        from .weights import module_seed

        g = torch.Generator().manual_seed(module_seed(seed, f"synthetic:{step}"))
        host = torch.device("cpu")  # batches are made on the host; the trainer copies them to the rank's device

        def draw(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            shape = (rows, *v.shape[1:]) if v.dim() else ()
            if v.is_floating_point():
                return torch.randn(shape, generator=g, dtype=v.dtype, device=host)
            if v.dtype == torch.bool:
                return torch.ones(shape, dtype=torch.bool, device=host)  # masks: attend everywhere
            return torch.randint(0, max(2, self.vocab_size), shape, generator=g, dtype=v.dtype, device=host)

        args, kwargs = pytree.tree_map(draw, (self.args, self.kwargs))
        return tuple(args), dict(kwargs)


def model_factory(
    spec: str, *, batch_size: int, seq_len: int, dropout: float | None = 0.0, seed: int = 0
) -> ModelSource:
    """Resolve a model spec once (on meta) and return how to rebuild it anywhere.

    ``dropout=0.0`` (the default) turns dropout off: pipelined and unpipelined runs then agree
    exactly; pass None to keep the model's own.
    """
    from pathlib import Path

    from ..models import load_model

    def build() -> nn.Module:
        device = torch.get_default_device()
        with torch.random.fork_rng(devices=[]):  # load_model seeds the global RNG; keep ours
            return load_model(spec, device=device, batch_size=batch_size, seq_len=seq_len, seed=seed, dropout=dropout).model

    with torch.random.fork_rng(devices=[]):
        example = load_model(spec, device="meta", batch_size=batch_size, seq_len=seq_len, seed=seed, dropout=dropout)
    task, vocab = example.task, example.vocab_size
    config = getattr(example.model, "config", None)
    if task == "custom" and config is not None:  # a factory returning a HF model: treat it as one
        from ..models import _task_of

        task = _task_of(type(example.model).__name__)
        vocab = int(getattr(config, "vocab_size", 0) or 0)
    weights = None
    folder = Path(spec)
    if folder.is_dir() and (list(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()):
        weights = str(folder)
    return ModelSource(
        name=spec,
        factory=build,
        args=tuple(example.args),
        kwargs=dict(example.kwargs),
        task=task,
        vocab_size=vocab,
        weights=weights,
    )
