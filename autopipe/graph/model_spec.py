"""The record every model source gives: the model, one micro-batch of example inputs, and what it is."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["ModelSpec"]


@dataclass
class ModelSpec:
    """A model with example inputs of the micro-batch shape, and what it is."""

    name: str
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    task: str = "custom"  # causal-lm | masked-lm | seq2seq | sequence-classification | image-classification | custom
    source: str = "builtin"  # builtin | folder | factory | torchtitan
    vocab_size: int = 0  # for synthetic token data; 0 when not a language model
    batch_size: int = 1
    seq_len: int = 0  # tokens per row of the example inputs (a factory's own, where it fixes them)
    loss: Any = None  # a factory's loss(outputs, target), if it gave one
    data: Any = None  # a factory's training data, if it gave some

    def __iter__(self) -> Iterator[Any]:
        """``model, args, kwargs = load_model(...)`` unpacks what flatten takes."""
        return iter((self.model, self.args, self.kwargs))
