"""A tiny Mixtral whose routers favour a few experts, as trained routers do, and its balanced twin.

A trained router's scores share a direction: the hidden states have a common mean component, and a
few experts' gate rows lean on it. Here that is made by hand: each biased layer's gate rows of its
``hot`` experts get ``strength`` times the unit mean of the router's inputs over a batch (the
untouched model's own inputs, found by a hook on the router), so those experts take most tokens.
Each factory returns the model and one micro-batch, as tests/zoo.py's do (a job can name them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

B, T, V = 4, 32, 128  # rows per micro-batch, tokens per row, vocabulary
EXPERTS, TOP_K, LAYERS = 8, 2, 6
BIASED = (0, 1)  # layers whose routers favour the hot experts
HOT = (0, 1)


def _ids(batch_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (batch_size, T), generator=torch.Generator().manual_seed(seed))


def _model(seed: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    config = transformers.MixtralConfig(vocab_size=V, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=T, intermediate_size=256,
                                        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)
    return transformers.MixtralForCausalLM(config)


def bias_routers(model: nn.Module, layers: tuple[int, ...] = BIASED, hot: tuple[int, ...] = HOT,
                 strength: float = 4.0, seed: int = 1) -> nn.Module:
    """Lean the gate rows of ``hot`` experts in ``layers`` on the mean direction of their router's inputs.
    A model on the meta device (a job's ranks build it there) is returned as it is: a job of this model
    gets the biased weights from ``--weights`` (bench/bench_moe_ep_step.py saves them), not from here."""
    if any(p.is_meta for p in model.parameters()):
        return model
    ids = _ids(8, seed)
    seen: dict[int, torch.Tensor] = {}
    handles = [model.model.layers[i].mlp.gate.register_forward_pre_hook(
        lambda m, a, i=i: seen.__setitem__(i, a[0].reshape(-1, a[0].shape[-1]).mean(0))) for i in layers]
    with torch.no_grad():
        model(ids)
        for h in handles:
            h.remove()
        for i in layers:
            mean = seen[i] / seen[i].norm()
            w = model.model.layers[i].mlp.gate.weight
            for e in hot:
                w[e] += strength * mean * w.norm(dim=1).mean()
    return model


def mixtral_balanced(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    ids = _ids(batch_size)
    return _model(), (ids,), {"labels": ids}


def mixtral_skewed(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    ids = _ids(batch_size)
    return bias_routers(_model()), (ids,), {"labels": ids}


def batches(n: int, batch_size: int = B, first_seed: int = 10) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """``n`` more micro-batches of random tokens (other seeds than the example's)."""
    return [((_ids(batch_size, first_seed + j),), {}) for j in range(n)]
