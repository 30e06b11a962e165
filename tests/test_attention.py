"""Traced attention runs as the eager model runs it (autopipe.graph.attention).

The untouched model is the reference: a HuggingFace decoder called without padding gives SDPA no
mask (``is_causal``) and un-repeated key/value heads (``enable_gqa``); its flattened layers must call
SDPA the same way and give the same outputs and gradients. Masks that are not SDPA's causal mask
(a sliding window, padding, a diagonal off by one) are kept, and so are the repeated heads then.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from archs import B, T, V, _ids
from test_flatten import _assert_same, _even, _run, _run_stages
from torch import fx, nn

import autopipe
import autopipe.graph.attention as attention
from autopipe.graph.attention import SDPA

torch.manual_seed(0)


def _calls(seq: Any) -> list[fx.Node]:
    return [n for layer in seq.layers for m in layer.modules() if isinstance(m, fx.GraphModule)
            for n in m.graph.nodes if n.target is SDPA]  # fmt: skip


def _llama(layers: int = 3) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def test_a_causal_gqa_decoder_calls_sdpa_as_its_eager_forward() -> None:
    """Llama with 4 query and 2 key/value heads: every SDPA call is causal without a mask and takes
    the 2 heads (no expand, no mask made on a stage), and the flattened model and its 2- and 3-stage
    splits give the untouched model's outputs, loss and gradients; the forward bit for bit."""
    model = _llama()
    ids = _ids()
    kwargs = {"labels": ids, "use_cache": False}
    seq = autopipe.flatten(model, (ids,), kwargs)
    calls = _calls(seq)
    assert len(calls) == 3
    for n in calls:
        assert n.kwargs.get("is_causal") is True and n.kwargs.get("enable_gqa") is True
        assert len(n.args) == 3 and "attn_mask" not in n.kwargs
        assert tuple(n.args[1].meta["val"].shape) == (B, 2, T, 8)  # the key/value heads themselves
    assert not any(n.target is torch.ops.aten.expand.default for layer in seq.layers for n in layer.graph.nodes)
    assert {s.dtype for info in seq.infos for s in info.computed} == {"float32"}  # rotary tables, no mask
    assert (seq.attention.calls, seq.attention.causal, seq.attention.gqa, seq.attention.masked) == (3, 3, 3, 0)

    with torch.no_grad():
        ref, got = model(ids, **kwargs), seq(ids, **kwargs)
    assert torch.equal(got.logits, ref.logits) and torch.equal(got.loss, ref.loss)
    ref = _run(model, lambda: model(ids, **kwargs))
    _assert_same(ref, _run(model, lambda: seq(ids, **kwargs)), "llama sequence")
    for stages in (2, 3):
        parts = seq.split(_even(len(seq), stages))
        _assert_same(ref, _run(model, lambda: _run_stages(parts, (ids,), kwargs)), f"llama {stages} stages")


def test_a_trace_on_meta_rewrites_as_one_with_weights() -> None:
    """The runtime flattens on meta (the mask is made from constants, so it is checked there too)
    and the plan was made from a trace with weights: both rewrite the same calls the same way."""
    from autopipe.runtime.stage.build import meta_model, to_meta

    ids = _ids()
    kwargs = {"labels": ids, "use_cache": False}
    real = autopipe.flatten(_llama(), (ids,), kwargs)
    meta = autopipe.flatten(meta_model(_llama), to_meta((ids,)), to_meta(kwargs), validate=False, device_type="cpu")

    def form(seq: Any) -> list[tuple]:
        return [(len(n.args), tuple(n.args[1].meta["val"].shape), sorted(n.kwargs.items())) for n in _calls(seq)]

    assert form(meta) == form(real) and len(form(real)) == 3
    assert (meta.attention.causal, meta.attention.gqa) == (real.attention.causal, real.attention.gqa) == (3, 3)


@pytest.mark.parametrize("case", ["sliding window", "padding"])
def test_a_mask_that_is_not_causal_stays(case: str) -> None:
    """Mistral's sliding window (3 < 8 tokens) and a padding mask the batch brings are no causal
    mask: the calls keep them and the repeated heads (HuggingFace's rule), and still give the
    untouched model's outputs and gradients."""
    ids = _ids()
    if case == "sliding window":
        from transformers import MistralConfig, MistralForCausalLM

        model = MistralForCausalLM(MistralConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                 num_key_value_heads=2, intermediate_size=48,
                                                 max_position_embeddings=32, sliding_window=3))  # fmt: skip
        kwargs: dict[str, Any] = {"labels": ids, "use_cache": False}
    else:
        model = _llama(layers=2)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[0, :3] = 0  # the first row is left-padded
        kwargs = {"attention_mask": mask, "labels": ids, "use_cache": False}
    seq = autopipe.flatten(model, (ids,), kwargs)
    assert (seq.attention.calls, seq.attention.causal, seq.attention.gqa, seq.attention.masked) == (2, 0, 0, 2)
    for n in _calls(seq):
        assert n.kwargs.get("is_causal", False) is False and isinstance(n.args[3], fx.Node)
    ref = _run(model, lambda: model(ids, **kwargs))
    _assert_same(ref, _run(model, lambda: seq(ids, **kwargs)), case)


class _Attention(nn.Module):
    """Grouped-query attention written by hand: 4 query heads over 2 key/value heads, repeated as
    HuggingFace's repeat_kv does; the mask is a bool or 0/-inf-style float ``tril(offset)``."""

    def __init__(self, offset: int, float_mask: bool) -> None:
        super().__init__()
        self.offset, self.float_mask = offset, float_mask
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 8), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, 4, 4).transpose(1, 2)
        k, v = (p(x).view(b, t, 2, 4).transpose(1, 2)[:, :, None].expand(b, 2, 2, t, 4).reshape(b, 4, t, 4)
                for p in (self.k, self.v))  # fmt: skip
        allowed = torch.ones(t, t, dtype=torch.bool, device=x.device).tril(self.offset)
        mask = allowed
        if self.float_mask:
            mask = torch.zeros(t, t, device=x.device).masked_fill(~allowed, torch.finfo(x.dtype).min)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + out.transpose(1, 2).reshape(b, t, 16)


class _Net(nn.Module):
    def __init__(self, offset: int, float_mask: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Attention(offset, float_mask) for _ in range(2)])
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("float_mask", [False, True], ids=["bool", "float"])
@pytest.mark.parametrize("offset", [0, 1, -1])
def test_only_the_exact_causal_mask_becomes_is_causal(offset: int, float_mask: bool) -> None:
    """tril(0) (bool, or 0 / the dtype's lowest float) is SDPA's causal mask; tril(1) and tril(-1)
    are not and stay, with their repeated heads. Every variant gives the untouched model's outputs
    and gradients."""
    model = _Net(offset, float_mask)
    x = torch.randn(B, T, 16)
    seq = autopipe.flatten(model, (x,))
    rewritten = offset == 0
    assert (seq.attention.causal, seq.attention.gqa) == ((2, 2) if rewritten else (0, 0))
    for n in _calls(seq):
        assert (n.kwargs.get("is_causal", False), n.kwargs.get("enable_gqa", False)) == (rewritten, rewritten)
    ref = _run(model, lambda: model(x))
    _assert_same(ref, _run(model, lambda: seq(x)), f"tril({offset})")


def test_a_mask_too_large_to_check_stays_with_a_note(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mask over the size the check evaluates is left as traced, and the sequence says so."""
    monkeypatch.setattr(attention, "MAX_MASK_ELEMENTS", T * T - 1)
    model = _Net(0, False)
    x = torch.randn(B, T, 16)
    seq = autopipe.flatten(model, (x,))
    assert (seq.attention.causal, seq.attention.masked) == (0, 2)
    assert any("too large to check" in note for note in seq.notes), seq.notes
    _assert_same(_run(model, lambda: model(x)), _run(model, lambda: seq(x)), "unchecked mask")
