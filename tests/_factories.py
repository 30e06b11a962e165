"""Test fixtures more than one test file writes out: small models of known shape."""

from __future__ import annotations

from pathlib import Path

# Four blocks of known shape: traces, profiles and partitions in about a second.
_NET = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(32, 4)

    def forward(self, x, y):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return nn.functional.cross_entropy(self.out(h), y)


def build(batch_size={batch_size}):
    return Net(), (torch.randn(batch_size, 16), torch.randint(0, 4, (batch_size,)))
'''


def net_factory_source(batch_size: int) -> str:
    """A factory file's text: ``build(batch_size)`` returns a 6-layer MLP with its own loss and inputs."""
    return _NET.format(batch_size=batch_size)


def tiny_gpt2_job(root: Path, *, layers: int, microbatches: int, rows: int, seq: int) -> Path:
    """``root/tiny``: a GPT-2 HF folder (config only: random init, tied wte/lm_head, no dropout) of
    ``layers`` blocks, width 32; and ``root/train.py`` for it, 2 stages on 1F1B. Returns the folder."""
    from transformers import GPT2Config

    from autopipe.job.script import write_train_script
    from autopipe.job.settings import JobSettings

    GPT2Config(
        architectures=["GPT2LMHeadModel"], n_layer=layers, n_embd=32, n_head=2, vocab_size=128, n_positions=seq,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
    ).save_pretrained(root / "tiny")
    write_train_script(root / "train.py", JobSettings(model=str(root / "tiny"), stages=2, microbatches=microbatches, schedule="1f1b", batch_size=rows, seq_len=seq))  # fmt: skip
    return root / "tiny"
