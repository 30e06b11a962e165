"""torchtitan's way of applying ``module_fqns_per_model_part``, written here for the export tests.

torchtitan (``pipeline_module_split``) and NeMo Automodel build each model part from a deep copy of the
whole model, keeping the modules listed for the part and dropping the rest; the model's forward skips
what is gone (torchtitan's Llama: ``h = self.tok_embeddings(tokens) if self.tok_embeddings else tokens``).
A HuggingFace model's forward does not, so a part runs ``llama_part_forward``: the same modules in
the same order, skipping the missing ones, as Automodel's patched forward does. Lists of layers
become dicts keyed by their index, so every parameter keeps its name in the whole model.
"""

from __future__ import annotations

import copy
import types
from typing import Sequence

import torch
from torch import nn

__all__ = ["keep_modules", "llama_part", "llama_part_forward", "tiny_llama", "causal_lm_loss"]


def keep_modules(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """A deep copy of ``model`` holding only the modules ``names`` (and the modules around them)."""
    part = copy.deepcopy(model)
    keep = set(names)

    def needed(path: str) -> bool:
        return path in keep or any(k.startswith(path + ".") for k in keep)

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            path = prefix + name
            if path in keep:
                continue
            if not needed(path):
                if isinstance(parent, nn.ModuleDict):
                    del parent[name]
                else:  # a list of layers none of which stays becomes an empty one, as in torchtitan
                    setattr(parent, name, nn.ModuleDict() if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else None)
                continue
            if isinstance(child, nn.ModuleList):  # keep the original indices as keys: names stay the same
                child = nn.ModuleDict({str(i): m for i, m in enumerate(child)})
                setattr(parent, name, child)
            visit(child, path + ".")

    visit(part, "")
    return part


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss HuggingFace's causal LMs compute from logits and labels."""
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))


def llama_part_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A LlamaForCausalLM part: token ids (first part) or hidden states in, hidden states or logits out."""
    inner = self.model
    h = inner.embed_tokens(x) if inner.embed_tokens is not None else x
    t = h.shape[1]
    pos = torch.arange(t, device=h.device).unsqueeze(0)
    cos_sin = inner.rotary_emb(h, pos)
    mask = torch.full((t, t), torch.finfo(h.dtype).min, device=h.device).triu(1)[None, None]
    for layer in inner.layers.values():
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        h = out[0] if isinstance(out, tuple) else out
    if inner.norm is not None:
        h = inner.norm(h)
    if self.lm_head is not None:
        h = self.lm_head(h)
    return h


def llama_part(model: nn.Module, names: Sequence[str]) -> nn.Module:
    part = keep_modules(model, names)
    part.forward = types.MethodType(llama_part_forward, part)
    return part


def tiny_llama(layers: int = 6, seed: int = 0) -> nn.Module:
    """A LlamaForCausalLM from a tiny config (width 32, untied, eager attention), seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                      tie_word_embeddings=False, attn_implementation="eager", use_cache=False)  # fmt: skip
    return LlamaForCausalLM(cfg).eval()
