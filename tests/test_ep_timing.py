"""The ep runner's own ops, timed on one rank (autopipe.runtime.checks.ep_timing) and priced at ep > 1.

What is timed is the runner itself: ``dispatch_combine`` on a loopback group of one. So first, that
function with its loopback and the model's own experts equals the untouched HuggingFace experts
module (a Mixtral's and a Qwen3-MoE's), outputs and the gradients of its inputs: the sort, gather,
put-back and top-k sum are the job's, not a stand-in. Then the timed figures land in every MoE
layer of a real profile, survive its JSON, and costs.ep adds exactly them at ep > 1 (nothing at ep 1).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tp_models  # noqa: E402

from autopipe.costs.ep import at_ep, ep_terms  # noqa: E402
from autopipe.costs.layer_costs import LayerCost, MoeShape, Profile  # noqa: E402
from autopipe.graph.expert_calls import experts_as_calls  # noqa: E402
from autopipe.runtime.checks.ep_timing import (loopback_all_to_all, loopback_exchange, time_ep_local,  # noqa: E402
                                               with_ep_local_timed)
from autopipe.runtime.stage.expert_parallel import EPLayout, dispatch_combine  # noqa: E402


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_aux"])
def test_the_timed_runner_on_a_loopback_is_the_untouched_experts_module(name: str) -> None:
    model = getattr(tp_models, name)()[0]
    experts = model.model.layers[0].mlp.experts
    gen = torch.Generator().manual_seed(3)
    tokens, hidden, k = 24, model.config.hidden_size, model.config.num_experts_per_tok
    x = torch.randn(tokens, hidden, generator=gen)
    index = torch.stack([torch.randperm(int(experts.num_experts), generator=gen)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=gen)

    ref_x, ref_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = experts(ref_x, index, ref_w)
    g = torch.randn(ref.shape, generator=gen)
    ref.backward(g)

    got_x, got_w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    with experts_as_calls(model) as calls:
        call = calls["model.layers.0.mlp.experts"]
        state = [experts._parameters[a] for a in call.params]
        got = dispatch_combine(call, EPLayout(ep=1, rank=0, group=None), got_x, index, got_w, state,
                               exchange=loopback_exchange, all_to_all_single=loopback_all_to_all)  # fmt: skip
    got.backward(g)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_x.grad, ref_x.grad)
    torch.testing.assert_close(got_w.grad, ref_w.grad)


def _moe(**kw: object) -> MoeShape:
    return MoeShape(experts=8, top_k=2, hidden=64, tokens=128, dispatch_bytes=128 * 2 * 64 * 4, expert_param_share=0.8,
                    expert_forward_share=0.6, loads=((40, 40, 30, 30, 30, 30, 28, 28),), **kw)  # fmt: skip


def test_each_moe_layer_gets_its_timed_ops_and_ep_prices_exactly_them() -> None:
    shape = _moe()
    layers = (LayerCost(0, name="embed", forward_time=1e-3, backward_time=2e-3),
              *(LayerCost(i, name=f"block{i}", forward_time=4e-3, backward_time=8e-3, param_bytes=1000, moe=shape)
                for i in (1, 2, 3)))  # fmt: skip
    prof = Profile(layers=layers)
    timed = with_ep_local_timed(prof, warmup=1, repeats=3)
    lf, lb = timed.layers[1].moe.local_forward, timed.layers[1].moe.local_backward
    assert lf > 0 and lb > 0
    # one shape, timed once: every layer carries the same figures; the dense layer none
    assert all((l.moe.local_forward, l.moe.local_backward) == (lf, lb) for l in timed.layers[1:])
    assert timed.layers[0] == prof.layers[0]
    again = Profile.from_dict(json.loads(json.dumps(timed.to_dict())))
    assert again.layers[2].moe == timed.layers[2].moe

    assert at_ep(timed, 1, bandwidth=1e9) is timed
    plain, with_ops = at_ep(prof, 2, bandwidth=1e9), at_ep(timed, 2, bandwidth=1e9)
    for a, b in zip(plain.layers[1:], with_ops.layers[1:]):
        assert b.forward_time - a.forward_time == pytest.approx(lf)
        assert b.backward_time - a.backward_time == pytest.approx(lb)
    assert [t.local for t in ep_terms(timed, 2, bandwidth=1e9)] == [pytest.approx(lf + lb)] * 3
    assert [t.local for t in ep_terms(timed, 1, bandwidth=1e9)] == [0.0] * 3


def test_the_runner_s_ops_grow_with_the_slots() -> None:
    """A layer of 8x the tokens sorts, gathers and puts back 8x the slots: its figure is larger (medians
    of a handful of runs; the ratio is loose, since a small call is mostly fixed overhead)."""
    small = time_ep_local(_moe(), warmup=2, repeats=7)
    large = time_ep_local(replace(_moe(), tokens=128 * 8, dispatch_bytes=128 * 8 * 2 * 64 * 4), warmup=2, repeats=7)
    assert sum(large) > 1.5 * sum(small), (small, large)
