"""Every causal LM the installed transformers maps (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), from a tiny config.

A config is the architecture's own defaults with its sizes shrunk (hidden 32, 2 layers, vocabulary
96, 4 experts), dropout off, and for hybrids one layer of each kind its ``layer_types`` names; a few
architectures need a size of their own (``OVERRIDES``). Each builder returns (model, args, kwargs)
like tests/archs.py's: token ids, a padded attention mask, labels (the model's own loss), no cache.
Models are built once per process (``build`` caches them), in training mode.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch import nn

from archs import B, T, V, Built, _ids, _mask

# the sizes every config takes where it has the field: small enough that a flatten costs the trace alone
SIZES: dict[str, Any] = {
    "vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64, "moe_intermediate_size": 24,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "shared_expert_intermediate_size": 24, "shared_intermediate_size": 24, "kv_lora_rank": 16, "q_lora_rank": 16,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "first_k_dense_replace": 1, "n_group": 1,
    "topk_group": 1, "sliding_window": 4, "sliding_window_size": 4, "d_model": 32, "n_embd": 32, "n_layer": 2,
    "n_head": 4, "n_heads": 4, "n_layers": 2, "num_layers": 2, "num_heads": 4, "n_positions": 64, "n_inner": 48,
    "ffn_dim": 48, "d_ff": 48, "ffn_hidden_size": 48, "encoder_layers": 1, "decoder_layers": 2,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 48, "decoder_ffn_dim": 48,
    "state_size": 8, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1,
    "mamba_expand": 2, "expand": 2, "time_step_rank": 4, "mamba_dt_rank": 4, "n_groups": 1, "chunk_size": 8,
    "mamba_chunk_size": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4, "num_mtp_layers": 0,
    "num_nextn_predict_layers": 0, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 8,
    "embedding_size": 32, "rotary_dim": 4, "decoder_sparse_step": 1, "num_dense_layers": 1,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": V, "attention_hidden_size": 32,
    "max_seq_len": 64, "block_size": 64, "num_kv_shared_layers": 0,
}
# architecture-specific fields (a field name these share means something else there)
OVERRIDES: dict[str, dict[str, Any]] = {
    "reformer": dict(is_decoder=True, num_attention_heads=2, attention_head_size=16, feed_forward_size=32,
                     axial_pos_embds=False, attn_layers=["local", "lsh"], local_attn_chunk_length=4,
                     lsh_attn_chunk_length=4, num_buckets=2),
    # latent attention needs a key/value head per query head; a few zero-computation experts beside the 4 routed
    "longcat_flash": dict(num_key_value_heads=4, expert_ffn_hidden_size=24, zero_expert_num=2),
    **{name: dict(num_key_value_heads=4) for name in ("axk1", "axk2", "deepseek_v2", "deepseek_v3", "deepseek_v32",
                                                      "dots3_note", "dots3_note_text", "glm4_moe_lite", "glm_moe_dsa", "minicpm3", "sarvam_mla", "youtu")},
    "falcon_h1": dict(mamba_d_ssm=64),  # its Mamba width: mamba_n_heads x mamba_d_head
    "ernie4_5_moe": dict(moe_k=2),
    "mamba2": dict(head_dim=16),  # num_heads x head_dim = expand x hidden
    # DbrxAttention reads attn_config.rope_theta, a field its config class lacks (the rotary embedding uses
    # rope_parameters), and clamps by clip_qkv, which fails at its default None (DBRX's own is 8); the FFN's
    # top-k as the others' num_experts_per_tok
    "dbrx": dict(attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                 ffn_config=dict(ffn_hidden_size=48, moe_num_experts=4, moe_top_k=2)),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # no default: one layer of each kind
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),  # one layer of each kind  # its top-k field (num_experts_per_tok is an alias it does not take)
}
# composite configs whose ForCausalLM takes the text sub-config alone (as AutoModelForCausalLM.from_config passes it)
TEXT_CONFIG = {"llama4", "qwen3_5", "qwen3_5_moe", "qwen4_exp"}
# flattened at leaf granularity: fewer than 3 blocks at block granularity (Reformer's reversible stack is one call)
LEAF = {"reformer"}
# no attention mask: Reformer's attention branches on the mask's values (a data-dependent guard in the trace)
NO_MASK = {"reformer"}


def _is_float_field(cls: type, name: str) -> bool:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    return name in fields and "float" in str(fields[name].type)


def _shrunk(cls: type, extra: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that shrink config class ``cls`` (dropouts off), sub-configs likewise."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in SIZES.items() if k in names}
    for name in names:
        low = name.lower()
        if ("dropout" in low or "pdrop" in low or "layerdrop" in low) and _is_float_field(cls, name):
            kwargs[name] = 0.0
        if low.endswith("token_id") and name not in extra:
            kwargs[name] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(name, 3)
    sub = getattr(cls, "sub_configs", {}) or {}
    for name, sub_cls in sub.items():
        if name in names and isinstance(sub_cls, type) and dataclasses.is_dataclass(sub_cls):
            kwargs[name] = _shrunk(sub_cls, {})
    kwargs.update(extra)
    return kwargs


def config(model_type: str) -> Any:
    """The tiny config of ``model_type``: one layer of each kind its default ``layer_types`` names."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kwargs = _shrunk(cls, OVERRIDES.get(model_type, {}))
    cfg = cls(**kwargs)
    text = getattr(cfg, "text_config", None) or cfg
    kinds = getattr(text, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and len(set(kinds)) > 1 and "layer_types" not in OVERRIDES.get(model_type, {}):
        one_each = list(dict.fromkeys(kinds))
        if text is cfg:
            cfg = cls(**{**kwargs, "layer_types": one_each, "num_hidden_layers": len(one_each)})
        else:
            sub = {**kwargs.get("text_config", {}), "layer_types": one_each, "num_hidden_layers": len(one_each)}
            cfg = cls(**{**kwargs, "text_config": sub})
    return cfg.get_text_config() if model_type in TEXT_CONFIG else cfg


def _model_class(model_type: str) -> type:
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


@functools.cache
def _built(model_type: str) -> Built:
    torch.manual_seed(0)
    model = _model_class(model_type)(config(model_type)).train()
    for module in model.modules():  # config names for dropout vary; tests compare runs exactly
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    ids = _ids(vocab=V)
    mask = {} if model_type in NO_MASK else {"attention_mask": _mask()}
    return model, (ids,), {**mask, "labels": ids, "use_cache": False}


def build(model_type: str) -> Built:
    """The tiny model of ``model_type`` (built once per process) and its example batch."""
    return _built(model_type)


def names() -> list[str]:
    """Every model type the installed transformers maps to a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


__all__ = ["build", "config", "names", "SIZES", "OVERRIDES", "LEAF", "B", "T", "V"]
