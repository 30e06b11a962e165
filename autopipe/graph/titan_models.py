"""torchtitan's own models as a model source: ``torchtitan:MODULE:FLAVOR[,field=value,...]``.

A torchtitan user trains a model of torchtitan's registry (``torchtitan:llama3:8B`` is
``torchtitan.models.llama3.model_registry("8B")``); autopipe profiles and plans that very model, on the
meta device if asked, and its plan exports in the model's own module names (``tok_embeddings``,
``layers.N``, ``norm``, ``lm_head``). ``field=value`` sets a field of the model's config first
(``torchtitan:qwen3:0.6B,enable_weight_tying=false``: torchtitan refuses tied weights under pipeline
parallelism).

torch.export cannot trace flex attention's BlockMask (nor varlen's metadata), and torchtitan 0.3 refuses
``attn_backend="sdpa"`` for language models, so for measurement each layer's inner attention is
torchtitan's own ScaledDotProductAttention (causal): the same modules and parameters under the same
names, the same outputs for one document per row (flex's document mask is then causal), and the
same cost to within the attention kernel's.

Example:
    >>> parse_titan_spec("torchtitan:qwen3:0.6B,enable_weight_tying=false")
    TitanModel(module='qwen3', flavor='0.6B', fields=(('enable_weight_tying', False),))
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ModelNotFoundError

__all__ = ["TITAN_PREFIX", "TitanModel", "is_titan_spec", "parse_titan_spec", "titan_model_config", "load_titan",
           "titan_loss"]

TITAN_PREFIX = "torchtitan:"


@dataclass(frozen=True)
class TitanModel:
    """A torchtitan registry model: its module under torchtitan.models, its flavour, the config fields set."""

    module: str
    flavor: str
    fields: tuple[tuple[str, Any], ...] = ()

    @property
    def spec(self) -> str:
        extra = "".join(f",{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.fields)
        return f"{TITAN_PREFIX}{self.module}:{self.flavor}{extra}"


def is_titan_spec(spec: str) -> bool:
    return isinstance(spec, str) and spec.startswith(TITAN_PREFIX)


def _value(text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_titan_spec(spec: str) -> TitanModel:
    """``torchtitan:MODULE:FLAVOR[,field=value...]`` -> TitanModel; one line when it is not that shape."""
    body = spec[len(TITAN_PREFIX):] if is_titan_spec(spec) else spec
    module, colon, rest = body.partition(":")
    flavor, *settings = rest.split(",")
    if not colon or not module or not flavor:
        raise ModelNotFoundError(f"model {spec!r}: a torchtitan model is torchtitan:MODULE:FLAVOR "
                                 "(e.g. torchtitan:llama3:debugmodel), optionally ,field=value after it.")
    pairs = []
    for s in settings:
        key, eq, value = s.partition("=")
        if not eq or not key.strip():
            raise ModelNotFoundError(f"model {spec!r}: {s!r} is not field=value (e.g. enable_weight_tying=false).")
        pairs.append((key.strip(), _value(value)))
    return TitanModel(module.strip(), flavor.strip(), tuple(pairs))


def _registry(tm: TitanModel) -> Any:
    try:
        package = importlib.import_module(f"torchtitan.models.{tm.module}")
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "torchtitan" and e.name != "torchtitan":
            raise ModelNotFoundError(f"torchtitan has no model {tm.module!r} (torchtitan.models.{tm.module}); "
                                     "name one of its models, e.g. torchtitan:llama3:debugmodel.") from None
        raise ModelNotFoundError(f"torchtitan:{tm.module} needs torchtitan (pip install torchtitan) and what it "
                                 f"imports: {e.name} is missing.") from None
    registry = getattr(package, "model_registry", None)
    if registry is None:
        raise ModelNotFoundError(f"torchtitan.models.{tm.module} has no model_registry (torchtitan 0.3 or later "
                                 "builds models from it); install torchtitan>=0.3 to profile its models.")
    return registry


def titan_model_config(tm: TitanModel, *, sdpa: bool = True) -> Any:
    """The model's config from torchtitan's registry with ``tm.fields`` set and, with ``sdpa``, each
    layer's inner attention replaced by ScaledDotProductAttention (traceable; see the module doc)."""
    registry = _registry(tm)
    try:
        config = registry(tm.flavor).model
    except KeyError:
        flavors = getattr(importlib.import_module(f"torchtitan.models.{tm.module}"), f"{tm.module}_configs", {})
        raise ModelNotFoundError(f"torchtitan's {tm.module} has no flavour {tm.flavor!r}; use one of "
                                 f"{', '.join(flavors) or 'its registry names'}.") from None
    known = {f.name for f in fields(config)} if is_dataclass(config) else set()
    for key, value in tm.fields:
        if key not in known:
            scalar = sorted(k for k in known if isinstance(getattr(config, k), (bool, int, float, str)))
            raise ModelNotFoundError(f"torchtitan's {tm.module} config has no field {key!r}; settable: "
                                     f"{', '.join(scalar)}.")
        setattr(config, key, value)
    if sdpa:
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in getattr(config, "layers", ()):
            attention = getattr(layer, "attention", None)
            if attention is not None and hasattr(attention, "inner_attention"):
                attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def titan_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's language-model loss: cross-entropy of every position's logits against its label
    (its data loader gives the labels already shifted by one token)."""
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def load_titan(spec: str, device: torch.device, batch_size: int, seq_len: int, seed: int = 0) -> Any:
    """The model of ``spec`` on ``device`` (meta: no weights; else torchtitan's own initialisation,
    seeded) with example token ids of ``(batch_size, seq_len)`` and torchtitan's loss."""
    from .model_spec import ModelSpec

    tm = parse_titan_spec(spec)
    config = titan_model_config(tm)
    limit = getattr(config, "max_seq_len", seq_len)
    if seq_len > limit:
        raise ModelNotFoundError(f"--seq-len {seq_len} is longer than {spec}'s {limit} positions; use at most {limit}.")
    torch.manual_seed(seed)
    with torch.device(device):
        model = config.build()
    if device.type != "meta":
        model.init_states(buffer_device=device)
    model.train()
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g).to(device)
    return ModelSpec(tm.spec, model, (ids,), {}, "custom", "torchtitan", vocab, batch_size, seq_len, loss=titan_loss)
