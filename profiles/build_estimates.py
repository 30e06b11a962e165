"""Rebuild the estimated profiles in this folder (no weights, no GPU: meta tensors and a roofline).

    python profiles/build_estimates.py

GPT-2 124M (GPT2Config() defaults) and a Llama-7B-shaped config, both as `train.py --dtype bf16`
trains them (autocast over fp32 master weights, AdamW), micro-batch 1 x seq_len, estimated for an H100.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

import autopipe
from autopipe.reserve import ASSUMED_CUDA_RESERVE

HERE = Path(__file__).resolve().parent


def _estimate(model: torch.nn.Module, seq_len: int, name: str, out: str) -> None:
    model = model.to(torch.bfloat16)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    seq = autopipe.flatten(model, (ids,))
    # As train.py --dtype bf16 trains: autocast over fp32 masters (estimated on the 16-bit model, with
    # autocast's weight copies added), and the runtime reserve assumed for a GPU.
    prof = autopipe.profile(seq, (ids,), estimate=True, device="h100", autocast="bfloat16",
                            reserve=ASSUMED_CUDA_RESERVE)
    prof = dataclasses.replace(prof, model=name)
    prof.save(HERE / out)
    print(f"{out}: {len(prof.layers)} layers, {sum(prof.times) * 1e3:.2f} ms per micro-batch", file=sys.stderr)


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(use_cache=False))
    _estimate(gpt2, 1024, "gpt2", "gpt2-h100-estimate.json")
    llama_cfg = LlamaConfig(
        hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, use_cache=False,
    )
    with torch.device("meta"):
        llama = LlamaForCausalLM(llama_cfg)
    _estimate(llama, 2048, "llama-7b", "llama-7b-h100-estimate.json")


if __name__ == "__main__":
    main()
