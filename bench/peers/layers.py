"""The layers a pipeline user writes by hand for a HuggingFace GPT-2 or Llama, as the DeepSpeed and
torch pipelining tutorials teach: an embedding, one layer per transformer block, the final norm and
the LM head, each taking and returning one hidden-state tensor.

Shared by the two bare scripts of ``bench/bench_peers.py`` (``hand_torch.py``, ``hand_deepspeed.py``):
the same modules, the same weights (autopipe's seeded initialisation, so every method starts equal)
and the same loss (next-token cross-entropy, as the models compute their own).

``LAYER_NAMES`` says which module of the model each layer runs, in autopipe's layer order (both
models flatten to embedding, blocks, norm, head), so a plan's boundaries index these layers too.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Block", "Embed", "Head", "Norm", "layer_names", "loss_fn", "param_groups", "user_layers"]


class Embed(nn.Module):
    """Token (and GPT-2's learned position) embedding: ids -> hidden states."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Embedding | None = None) -> None:
        super().__init__()
        self.tokens, self.positions = tokens, positions

    @property
    def weight(self) -> torch.Tensor:  # the tied tensor (GPT-2's head uses it)
        return self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return h


class Block(nn.Module):
    """One transformer block; Llama's rotary embedding is computed where the block runs (causal
    attention: no mask, so SDPA's own causal path, as the whole model takes)."""

    def __init__(self, block: nn.Module, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.block, self.rotary = block, rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.rotary is None:
            out = self.block(h)
        else:
            positions = torch.arange(h.shape[1], device=h.device)[None]
            out = self.block(h, position_embeddings=self.rotary(h, positions), position_ids=positions)
        return out[0] if isinstance(out, tuple) else out


class Norm(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)


class Head(nn.Module):
    """The LM head: hidden states -> logits."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


def user_layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers as a user lists them (GPT2LMHeadModel or LlamaForCausalLM)."""
    if hasattr(model, "transformer"):  # GPT-2
        tr = model.transformer
        return [Embed(tr.wte, tr.wpe), *[Block(b) for b in tr.h], Norm(tr.ln_f), Head(model.lm_head)]
    inner = model.model
    return [Embed(inner.embed_tokens), *[Block(b, inner.rotary_emb) for b in inner.layers], Norm(inner.norm),
            Head(model.lm_head)]  # fmt: skip


def layer_names(model: nn.Module) -> list[str]:
    """The module each user layer runs, by its name in the model (autopipe's layer names)."""
    if hasattr(model, "transformer"):
        n = len(model.transformer.h)
        return ["transformer.wte", *[f"transformer.h.{i}" for i in range(n)], "transformer.ln_f", "lm_head"]
    n = len(model.model.layers)
    return ["model.embed_tokens", *[f"model.layers.{i}" for i in range(n)], "model.norm", "lm_head"]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, as GPT-2 and Llama compute their own loss from ``labels``."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def param_groups(params: list[nn.Parameter], weight_decay: float = 0.1) -> list[dict]:
    """AdamW's groups as nanoGPT makes them (and autopipe): decay on matrices only."""
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
