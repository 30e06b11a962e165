"""The model a training job rebuilds on every rank: a factory plus one micro-batch of example inputs.

``model_factory("gpt2", batch_size=2, seq_len=128)`` wraps ``autopipe.graph.sources.load_model`` (built-in
names, local HF folders, ``module:function`` factories) as a zero-argument factory that builds on
whatever device is current, so the runtime can build it on meta (every rank), on the CPU (the
reference), or not at all. It also says what the job trains the model on: its task, its loss
(``--loss``), the factory's data, and for a HF folder its tokenizer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import AutopipeError

__all__ = ["ModelSource", "model_factory"]


@dataclass
class ModelSource:
    """How to build the model, what its inputs look like (one micro-batch, on meta), and its loss."""

    name: str
    factory: Callable[[], nn.Module]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    task: str = "custom"
    vocab_size: int = 0
    weights: str | None = None  # a HF folder's safetensors, when it has them
    loss: Any = "model"  # "model" | "cross_entropy" | "mse" | a factory's loss(outputs, target)
    data: Any = None  # the factory's samples (autopipe.runtime.data.sources.SampleData), if it gave some
    arg_names: tuple[str, ...] = ()  # the forward's names of the positional args
    batch_size: int = 1  # rows per micro-batch the model was traced with (the factory's own, unless asked)
    tokenizer_dir: str | None = None  # a HF folder, whose tokenizer (if any) reads text data
    mask_token_id: int = 0  # masked LM: the id chosen tokens become
    pad_token_id: int = 0
    special_ids: tuple[int, ...] = ()  # never masked
    num_labels: int = 0  # classification heads: the number of classes

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
        from ..stage.weights import module_seed

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
    spec: str, *, batch_size: int | None, seq_len: int, dropout: float | None = None, seed: int = 0, loss: Any = "auto"
) -> ModelSource:
    """Resolve a model spec once (on meta) and return how to rebuild it anywhere.

    ``batch_size`` is the micro-batch; None keeps the model's own (a factory's example rows).

    ``dropout`` None (the default) keeps the model's own dropout (the runtime seeds it per
    micro-batch and layer, so pipelined and unpipelined runs still agree); a number overrides it.
    ``loss``: ``auto`` (the factory's loss if it gave one, else the model's own), ``model``,
    ``cross_entropy``, ``mse``. A HuggingFace model trained with another loss than its own is traced
    without ``labels``, so it returns its logits for that loss.
    """
    from pathlib import Path

    from ...graph.sources import load_model
    from .losses import resolve_loss

    def build() -> nn.Module:
        device = torch.get_default_device()
        with torch.random.fork_rng(devices=[]):  # load_model seeds the global RNG; keep ours
            # the folder's weights are read by the runtime, each rank only its own keys (build_stage)
            return load_model(spec, device=device, batch_size=batch_size, seq_len=seq_len, seed=seed, dropout=dropout,
                              weights=False).model

    with torch.random.fork_rng(devices=[]):
        example = load_model(spec, device="meta", batch_size=batch_size, seq_len=seq_len, seed=seed, dropout=dropout)
    batch_size = example.batch_size
    task, vocab = example.task, example.vocab_size
    config = getattr(example.model, "config", None)
    loss, kwargs = resolve_loss(spec, task, example.loss, loss, example.kwargs)
    weights = None
    folder = Path(spec)
    if folder.is_dir() and (list(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()):
        weights = str(folder)
    tokenizer_dir = str(folder) if folder.is_dir() else None
    mask_id, pad_id, special = _special_tokens(tokenizer_dir, config, vocab)
    data = _factory_data(example.data, spec) if example.data is not None else None
    return ModelSource(
        name=spec,
        factory=build,
        args=tuple(example.args),
        kwargs=kwargs,
        task=task,
        vocab_size=vocab,
        weights=weights,
        loss=loss,
        data=data,
        arg_names=_arg_names(example.model, len(example.args)),
        batch_size=batch_size,
        tokenizer_dir=tokenizer_dir,
        mask_token_id=mask_id,
        pad_token_id=pad_id,
        special_ids=special,
        num_labels=int(getattr(config, "num_labels", 0) or 0) if task.endswith("classification") else 0,
    )


def _arg_names(model: nn.Module, n: int) -> tuple[str, ...]:
    try:
        params = [p.name for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return tuple(params[i] if i < len(params) else f"arg{i}" for i in range(n))


def _special_tokens(folder: str | None, config: Any, vocab: int) -> tuple[int, int, tuple[int, ...]]:
    """(mask id, pad id, special ids) from the folder's tokenizer; without one, the config's pad id and
    the vocabulary's last id as the mask token (a model trained from scratch has no [MASK] of its own)."""
    from .sources import load_tokenizer

    tok = load_tokenizer(folder) if folder else None
    pad = getattr(config, "pad_token_id", None) if config is not None else None
    if tok is not None:
        mask = tok.mask_token_id if tok.mask_token_id is not None else max(vocab - 1, 0)
        pad = tok.pad_token_id if tok.pad_token_id is not None else pad
        return int(mask), int(pad or 0), tuple(sorted(set(tok.all_special_ids) - {mask}))
    mask = getattr(config, "mask_token_id", None) if config is not None else None
    mask = int(mask) if mask is not None else max(vocab - 1, 0)
    special = tuple(sorted({int(pad)} if pad is not None else set()))
    return mask, int(pad or 0), special


def _factory_data(data: Any, spec: str) -> Any:
    """A factory's data as samples: a dict of arrays/tensors, a map-style Dataset, or a function
    returning either (called here, on the host: tensors the factory made on meta hold no values)."""
    import numpy as np

    from .sources import DataError, samples_from_mapping

    if callable(data) and not hasattr(data, "__getitem__"):
        with torch.device("cpu"):
            data = data()
    where = f"{spec}'s data"
    if isinstance(data, dict):
        arrays = {}
        for k, v in data.items():
            if isinstance(v, torch.Tensor) and v.device.type == "meta":
                raise DataError(f"{where}: {k!r} is on the meta device (the factory runs on meta); return numpy arrays, "
                                "or a function that makes the data.")
            arrays[k] = v if isinstance(v, torch.Tensor) else np.asarray(v)
        from pathlib import Path

        return samples_from_mapping(Path(where), {k: (lambda v=v: v) for k, v in arrays.items()},
                                     {k: int(v.shape[0]) for k, v in arrays.items()})
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return _DatasetSamples(data, where)
    raise AutopipeError(f"{where} is a {type(data).__name__}; return a dict of arrays (x, y), a Dataset of (x, y), "
                        "or a function returning one.")


class _DatasetSamples:
    """A map-style Dataset of ``(x, y)`` pairs or dicts, read item by item (only the rows a step takes);
    it answers what :class:`~autopipe.runtime.data.sources.SampleData` answers."""

    def __init__(self, dataset: Any, where: str) -> None:
        from pathlib import Path

        from .sources import DataError

        self.dataset, self.path, self.n = dataset, Path(where), len(dataset)
        if self.n == 0:
            raise DataError(f"{where} is empty (0 samples).")
        first = dataset[0]
        self.names = list(first) if isinstance(first, dict) else ["x", "y"][: len(first)]

    def _item(self, i: int, name: str) -> torch.Tensor:
        item = self.dataset[int(i)]
        value = item[name] if isinstance(item, dict) else item[self.names.index(name)]
        return torch.as_tensor(value)

    def array(self, name: str) -> Any:
        return [self._item(i, name) for i in range(self.n)]

    def kind(self, name: str) -> str:
        return "array"

    def rows(self, name: str, index: Any) -> torch.Tensor:
        return torch.stack([self._item(i, name) for i in index])
