"""Tiny models for the tensor-parallel tests (hidden 64, 4 heads, 2 KV heads, seq 16): a Llama (ships
HuggingFace's tp_plan), a GPT-2 (no tp_plan: the plan is derived from its Conv1D graph; tied
embedding and head; dropout 0, see autopipe.runtime.stage.tensor_parallel) and a Qwen3-MoE decoder
(its experts run whole on each tp rank). For expert parallelism (tests/test_expert_parallel.py): a Mixtral and a
Qwen3-MoE with 4 experts, top-2, whose loss includes their load-balancing loss (``output_router_logits``,
coefficient 0.1 so it shows in the loss). Each factory returns the model and one micro-batch of inputs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

B, T, V = 2, 16, 96  # rows per micro-batch, tokens per row, vocabulary (96 splits over tp 2)


def _ids(batch_size: int) -> torch.Tensor:
    return torch.randint(0, V, (batch_size, T), generator=torch.Generator().manual_seed(0))


def _decoder(config_cls: str, model_cls: str, batch_size: int, **cfg: Any) -> tuple[nn.Module, tuple, dict]:
    import transformers

    config = getattr(transformers, config_cls)(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                               num_key_value_heads=2, max_position_embeddings=32, use_cache=False, **cfg)
    ids = _ids(batch_size)
    return getattr(transformers, model_cls)(config), (ids,), {"labels": ids}


def llama(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    return _decoder("LlamaConfig", "LlamaForCausalLM", batch_size, intermediate_size=128)


def qwen3_moe(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    return _decoder("Qwen3MoeConfig", "Qwen3MoeForCausalLM", batch_size, intermediate_size=128, head_dim=16,
                    moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                    mlp_only_layers=[])


def qwen3_moe_aux(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    return _decoder("Qwen3MoeConfig", "Qwen3MoeForCausalLM", batch_size, intermediate_size=128, head_dim=16,
                    moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                    mlp_only_layers=[], output_router_logits=True, router_aux_loss_coef=0.1)


def mixtral(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    return _decoder("MixtralConfig", "MixtralForCausalLM", batch_size, intermediate_size=32, num_local_experts=4,
                    num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.1)


def gpt2(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    import transformers

    config = transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    ids = _ids(batch_size)
    return transformers.GPT2LMHeadModel(config), (ids,), {"labels": ids}


def llama_bad_heads(batch_size: int = B) -> tuple[nn.Module, tuple, dict]:
    """3 attention heads: tp 2 cannot split them."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=V, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
                                      num_key_value_heads=3, intermediate_size=96, max_position_embeddings=32,
                                      use_cache=False)
    ids = _ids(batch_size)
    return transformers.LlamaForCausalLM(config), (ids,), {"labels": ids}
