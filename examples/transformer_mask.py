"""A transformer stack whose blocks take ``(hidden, mask)``, pipelined with no tuple packing by hand.

For DeepSpeed's PipelineModule every layer must take and return one tuple, so users rewrite blocks
whose forward takes several arguments into wrappers that unpack ``(hidden, mask)``, call the block,
and pack ``(hidden, mask)`` again; the embedding must return the mask too, and the last layer drop it:

    class PipeBlock(nn.Module):                      # by hand, for every block type
        def forward(self, inputs):
            hidden, mask = inputs
            return self.block(hidden, mask), mask

autopipe traces the model as it is written: whatever a later layer still needs (here the mask and
the labels) is carried across each cut in the tuple, automatically.

    python examples/transformer_mask.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["MaskedEncoder", "build"]


class Block(nn.Module):
    """Pre-norm self-attention + MLP; ``mask`` is True where a token may be attended to."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, c = hidden.shape
        q, k, v = self.qkv(self.norm1(hidden)).split(c, dim=-1)
        q, k, v = (x.view(b, t, self.heads, c // self.heads).transpose(1, 2) for x in (q, k, v))  # (B, nh, T, hs)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        hidden = hidden + self.proj(attn.transpose(1, 2).reshape(b, t, c))
        return hidden + self.mlp(self.norm2(hidden))


class MaskedEncoder(nn.Module):
    """Token classifier over padded sequences: embeddings, N blocks (hidden, mask), a head."""

    def __init__(self, vocab: int = 1000, width: int = 64, depth: int = 6, heads: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for block in self.blocks:
            hidden = block(hidden, mask)  # two arguments: no wrapper, no tuple
        logits = self.head(self.norm(hidden))
        # padding positions do not count in the loss: a weighted mean, not boolean indexing, so the
        # loss's shape does not depend on the mask's values and the model traces on the meta device
        # (as every training rank builds it)
        losses = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        keep = mask.flatten().to(losses.dtype)
        return (losses * keep).sum() / keep.sum()


def build(batch_size: int = 4, seq_len: int = 32) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Factory for `autopipe convert examples/transformer_mask.py:build --stages 3`: padded batches."""
    torch.manual_seed(0)
    ids = torch.randint(0, 1000, (batch_size, seq_len))
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,))
    mask = torch.arange(seq_len)[None, :] < lengths[:, None]  # True on real tokens, False on padding
    labels = torch.randint(0, 5, (batch_size, seq_len))
    return MaskedEncoder(), (ids, mask, labels)


if __name__ == "__main__":
    import autopipe

    model, args = build()
    seq = autopipe.flatten(model, args)
    plan = autopipe.partition(autopipe.profile(seq, args, repeats=3, warmup=1, progress=False), stages=3)
    print(f"{len(seq.layers)} layers, cut before layers {list(plan.boundaries[1:-1])}; what crosses each cut:")
    for cut in plan.boundaries[1:-1]:
        info = seq.infos[cut - 1]
        print(f"  after {info.name:10s} -> {', '.join(map(str, info.outputs))}")
    stages = seq.split(plan)
    x = stages[0](*args)
    for stage in stages[1:]:
        x = stage(*x) if isinstance(x, tuple) else stage(x)
    x.backward()
    piped = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    expected = model(*args)
    expected.backward()
    torch.testing.assert_close(x, expected)
    for name, p in model.named_parameters():
        torch.testing.assert_close(piped[name], p.grad, msg=lambda m: f"{name}: {m}")
    print(f"3 stages reproduce the model: loss {x.item():.4f}, gradients of {len(piped)} tensors equal")
