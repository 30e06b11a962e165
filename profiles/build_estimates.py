"""Rebuild the estimated profiles in this folder (no weights, no GPU: meta tensors and a roofline).

    python profiles/build_estimates.py

    python profiles/build_estimates.py llama-13b llama-70b     # only these

GPT-2 124M (GPT2Config() defaults) and Llama-7B, 13B and 70B-shaped configs (Llama 2's shapes; 70B
with grouped-query attention, 8 key/value heads), all as `train.py --dtype bf16` trains them (autocast
over fp32 master weights, AdamW), micro-batch 1 x seq_len, estimated for an H100. The profiler
estimates identical decoder layers once, so the 80-layer 70B traces in about as long as the 7B.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

import autopipe

HERE = Path(__file__).resolve().parent


def _estimate(model: torch.nn.Module, seq_len: int, name: str, out: str) -> None:
    model = model.to(torch.bfloat16)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    seq = autopipe.flatten(model, (ids,))
    # As train.py --dtype bf16 trains: autocast over fp32 masters (estimated on the 16-bit model, with
    # autocast's weight copies added). No reserve: the H100's row of the CUDA memory model (context,
    # workspaces, NCCL, allocator slack; autopipe/costs/gpu_memory.py) stands for the runtime's own.
    prof = autopipe.profile(seq, (ids,), estimate=True, device="h100", autocast="bfloat16", reserve=0)
    prof = dataclasses.replace(prof, model=name)
    prof.save(HERE / out)
    print(f"{out}: {len(prof.layers)} layers, {sum(prof.times) * 1e3:.2f} ms per micro-batch", file=sys.stderr)


# Llama 2's shapes: (hidden, intermediate, layers, heads, key/value heads)
LLAMAS = {
    "llama-7b": (4096, 11008, 32, 32, 32),
    "llama-13b": (5120, 13824, 40, 40, 40),
    "llama-70b": (8192, 28672, 80, 64, 8),
}


def main(names: list[str]) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    for name in names or ["gpt2", *LLAMAS]:
        if name == "gpt2":
            with torch.device("meta"):
                gpt2 = GPT2LMHeadModel(GPT2Config(use_cache=False))
            _estimate(gpt2, 1024, "gpt2", "gpt2-h100-estimate.json")
            continue
        hidden, inter, layers, heads, kv = LLAMAS[name]
        cfg = LlamaConfig(
            hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
            num_key_value_heads=kv, vocab_size=32000, max_position_embeddings=4096, use_cache=False,
        )
        with torch.device("meta"):
            llama = LlamaForCausalLM(cfg)
        _estimate(llama, 2048, name, f"{name}-h100-estimate.json")


if __name__ == "__main__":
    main(sys.argv[1:])
