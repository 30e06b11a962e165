"""Test fixtures more than one test file writes out: small models of known shape."""

from __future__ import annotations

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
