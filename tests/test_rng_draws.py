"""Which layers draw random numbers (autopipe.graph.rng.draws_random): the runtimes seed only those."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

import autopipe
from autopipe.graph.rng import draws_random


def _layers(kind: str, dropout: float) -> list[nn.Module]:
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                       num_key_value_heads=1, vocab_size=64, max_position_embeddings=16,
                                       attention_dropout=dropout)  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    model.train()
    ids = torch.randint(0, 64, (2, 16))
    return list(autopipe.flatten(model, (ids,), {"labels": ids, "use_cache": False}, validate=False).layers)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_a_model_without_dropout_draws_nothing_and_with_it_its_blocks_draw(kind: str) -> None:
    assert not any(draws_random(layer) for layer in _layers(kind, 0.0))
    draws = [draws_random(layer) for layer in _layers(kind, 0.1)]
    assert all(draws[1:3])  # the blocks: dropout (GPT-2) or attention dropout (Llama)
    assert draws[0] == (kind == "gpt2")  # GPT-2's embedding dropout; Llama has none
    assert not draws[-1]  # the head


def test_what_it_cannot_read_counts_as_drawing() -> None:
    """A module that is not a traced graph, a graph calling an operator torch tags as seeded with a
    probability that is not a literal 0, or a Python function it does not know: all draw."""
    assert draws_random(nn.Linear(2, 2))

    class Noisy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.rand_like(x)

    x = torch.ones(2, 2)
    noisy = torch.export.export(Noisy(), (x,)).module()
    assert draws_random(noisy)

    class Drop(nn.Module):
        def __init__(self, p: float) -> None:
            super().__init__()
            self.p = p

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return nn.functional.dropout(x, self.p, training=True) * 2

    assert draws_random(torch.export.export(Drop(0.5), (x,)).module())
    assert not draws_random(torch.export.export(Drop(0.0), (x,)).module())

    def helper(t: torch.Tensor) -> torch.Tensor:
        return t * 3

    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)))
    node = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(node):
        extra = gm.graph.call_function(helper, (node.args[0],))
    node.args = (extra,)
    gm.recompile()
    assert draws_random(gm)  # a call_module (nn.Linear) and a function of its own: not read, so drawing
