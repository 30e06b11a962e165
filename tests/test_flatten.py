"""Numerical equivalence of the flattened and split model with the original, on real architectures."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from archs import ALL, build
from torch import nn
from torch.utils import _pytree as pytree

import autopipe

TOL = dict(rtol=1e-5, atol=1e-5)


def _loss(out: Any) -> torch.Tensor:
    """A scalar touching every float output with fixed random weights (so every gradient matters)."""
    total = torch.zeros(())
    for k, leaf in enumerate(x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)):
        if leaf.is_floating_point():
            w = torch.randn(leaf.shape, generator=torch.Generator().manual_seed(k))
            total = total + (leaf * w).sum()
    return total


def _run(model: torch.nn.Module, fn: Callable[[], Any]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Forward + backward through ``fn``; returns outputs, grads and buffers, then restores the model."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.zero_grad(set_to_none=True)
    out = fn()
    _loss(out).backward()
    outs = [x.detach().clone() for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    bufs = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    model.load_state_dict(state)
    return outs, grads, bufs


def _even(num_layers: int, stages: int) -> list[int]:
    return [round(s * num_layers / stages) for s in range(stages + 1)]


def _run_stages(stages: list[torch.nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x = stages[0](*args, **kwargs)
    for stage in stages[1:]:
        x = stage(*x) if isinstance(x, tuple) else stage(x)
    return x


def _assert_same(ref: tuple, got: tuple, what: str) -> None:
    ref_out, ref_grads, ref_bufs = ref
    got_out, got_grads, got_bufs = got
    assert len(ref_out) == len(got_out), what
    for r, g in zip(ref_out, got_out):
        torch.testing.assert_close(g, r, **TOL, msg=f"{what}: outputs differ")
    assert set(ref_grads) == set(got_grads), f"{what}: parameters with gradients differ"
    for name in ref_grads:
        torch.testing.assert_close(got_grads[name], ref_grads[name], **TOL, msg=f"{what}: grad of {name}")
    for name in ref_bufs:
        torch.testing.assert_close(got_bufs[name], ref_bufs[name], **TOL, msg=f"{what}: buffer {name}")


@pytest.mark.parametrize("arch", sorted(ALL))
def test_sequence_and_splits_match_model(arch: str) -> None:
    """seq(...) and its 2/3/4-stage splits give the model's outputs, parameter gradients and buffers."""
    model, args, kwargs = build(arch)
    ref = _run(model, lambda: model(*args, **kwargs))
    seq = autopipe.flatten(model, args, kwargs)
    assert len(seq) >= 4, f"{arch} flattened to only {len(seq)} layers"
    _assert_same(ref, _run(model, lambda: seq(*args, **kwargs)), f"{arch} sequence")
    for stages in (2, 3, 4):
        parts = seq.split(_even(len(seq), stages))
        assert len(parts) == stages
        _assert_same(ref, _run(model, lambda: _run_stages(parts, args, kwargs)), f"{arch} {stages} stages")
    # The model's own structure comes back (ModelOutput, dict, tensor).
    assert type(seq(*args, **kwargs)) is type(model(*args, **kwargs))


@pytest.mark.parametrize("arch", ["gpt2", "t5", "albert"])
def test_layers_hold_the_models_own_parameters(arch: str) -> None:
    """Each layer registers the model's Parameter objects under their original names: nothing is copied."""
    model, args, kwargs = build(arch)
    seq = autopipe.flatten(model, args, kwargs)
    for layer, info in zip(seq.layers, seq.infos):
        for name in info.param_names:
            assert layer.get_parameter(name) is model.get_parameter(name)
    held = {id(p) for layer in seq.layers for p in layer.parameters()}
    assert held == {id(p) for p in model.parameters()}


def test_gpt2_tied_embedding_found_by_identity() -> None:
    """GPT-2's wte and lm_head share one tensor: one tied group naming both, used by first and last layer."""
    model, args, kwargs = build("gpt2")
    seq = autopipe.flatten(model, args, kwargs)
    assert [g.names for g in seq.tied] == [("lm_head.weight", "transformer.wte.weight")]
    assert seq.tied[0].layers == (0, len(seq) - 1)
    assert seq.infos[0].tied == seq.infos[-1].tied == ("lm_head.weight",)
    # Each layer holds the tensor under the name of the module that uses it.
    assert seq.infos[0].param_names[0] == "transformer.wte.weight"
    assert seq.infos[-1].param_names == ("lm_head.weight",)


def test_t5_shared_embedding_is_one_group_of_four_names() -> None:
    """T5 ties four names to one tensor; identity, not names, makes them one group."""
    model, args, kwargs = build("t5")
    seq = autopipe.flatten(model, args, kwargs)
    shared = [g for g in seq.tied if "shared.weight" in g.names]
    assert len(shared) == 1
    assert set(shared[0].names) == {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}


def test_albert_shared_layer_is_in_every_layer_that_runs_it() -> None:
    """ALBERT runs one layer four times: four layers hold its weights, tied, and gradients sum across them."""
    model, args, kwargs = build("albert")
    seq = autopipe.flatten(model, args, kwargs)
    repeats = [info for info in seq.infos if "albert_layer_groups.0" in info.name]
    assert len(repeats) == 4
    assert [info.name.endswith(f"(call {k + 1})") for k, info in enumerate(repeats)][1:] == [True] * 3
    shared = "albert.encoder.albert_layer_groups.0.albert_layers.0.attention.query.weight"
    group = next(g for g in seq.tied if shared in g.names)
    assert len(group.layers) == 4


def test_encoder_output_is_live_across_decoder_cuts() -> None:
    """T5: the encoder's output crosses every cut up to the last decoder block."""
    model, args, kwargs = build("t5")
    seq = autopipe.flatten(model, args, kwargs)
    dec = [i for i, info in enumerate(seq.infos) if info.name.startswith("decoder.block.")]
    assert len(dec) == 3
    for i in dec:
        assert any(s.shape == (2, 8, 32) and s.dtype == "float32" for s in seq.infos[i].inputs)
        assert len(seq.infos[i].inputs) >= 3  # hidden, encoder states, masks/bias, labels


def test_unet_skip_tensors_are_packed() -> None:
    """A long skip (down1 -> up1) is carried through every cut in between."""
    model, args, kwargs = build("unet")
    seq = autopipe.flatten(model, args, kwargs)
    names = [info.name for info in seq.infos]
    assert names[-2:] == ["up2", "up1"] and names[0] == "down1.0", names
    bottom = names.index("bottom.0")
    # d1 (2,8,16,16) rides along from down1 to up1, d2 from down2 to up2.
    for info in seq.infos[bottom : len(names) - 1]:
        assert (2, 8, 16, 16) in [s.shape for s in info.inputs]
    assert [s.shape for s in seq.infos[-1].inputs] == [(2, 8, 16, 16), (2, 8, 16, 16)]


def test_layers_take_tensor_or_tuple_and_return_one() -> None:
    """DeepSpeed's convention: one Tensor or a tuple of Tensors in, the same kind out."""
    model, args, kwargs = build("masked_transformer")
    seq = autopipe.flatten(model, args, kwargs)
    x: Any = seq.pack_inputs(args, kwargs)
    bare_inputs = 0
    for layer in seq.layers:
        if isinstance(x, torch.Tensor):  # a bare Tensor and a one-element tuple are the same input
            torch.testing.assert_close(layer(x), layer((x,)))
            bare_inputs += 1
        x = layer(x)
        assert isinstance(x, torch.Tensor) or (isinstance(x, tuple) and all(isinstance(t, torch.Tensor) for t in x))
    assert bare_inputs >= 1


def test_batchnorm_running_stats_update_like_eager() -> None:
    """Train-mode BatchNorm: the flattened model updates the original buffers exactly as eager does."""
    model, args, kwargs = build("batchnorm")
    before = model.blocks[0][1].running_mean.clone()
    expected = _run(model, lambda: model(*args))[2]
    seq = autopipe.flatten(model, args, kwargs)
    torch.testing.assert_close(model.blocks[0][1].running_mean, before)  # flatten changed nothing
    seq(*args)
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, expected[name], msg=name)
    assert not torch.equal(model.blocks[0][1].running_mean, before)


def test_leaf_and_coarse_granularity() -> None:
    """granularity='leaf' gives more layers, blocks_per_layer=2 fewer; all match the model."""
    model, args, kwargs = build("gpt2")
    ref = _run(model, lambda: model(*args, **kwargs))
    block = autopipe.flatten(model, args, kwargs)
    leaf = autopipe.flatten(model, args, kwargs, granularity="leaf")
    coarse = autopipe.flatten(model, args, kwargs, blocks_per_layer=2)
    assert len(leaf) > len(block) > len(coarse)
    assert any(info.name == "transformer.h.0.attn.c_attn" for info in leaf.infos)
    assert any(info.name == "transformer.h.0..transformer.h.1" for info in coarse.infos)
    for seq in (leaf, coarse):
        _assert_same(ref, _run(model, lambda: seq(*args, **kwargs)), "granularity")
        assert seq.signature != block.signature


def test_flatten_does_not_modify_the_model() -> None:
    """Flattening leaves every parameter and buffer of the model as it was."""
    model, args, kwargs = build("bert")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    autopipe.flatten(model, args, kwargs)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


def test_identical_blocks_share_a_structure_key() -> None:
    """Blocks with the same ops and shapes get one structure key (the profiler measures them once)."""
    model, args, kwargs = build("llama")
    seq = autopipe.flatten(model, args, kwargs)
    blocks = [info for info in seq.infos if info.kind == "LlamaDecoderLayer"]
    assert len(blocks) == 3
    # The last block returns fewer values (nothing is carried past it), so its key differs.
    assert blocks[0].structure == blocks[1].structure != blocks[2].structure
    assert seq.infos[0].structure != blocks[0].structure


def test_bloom_custom_autograd_function_is_reported() -> None:
    """BLOOM's train-mode GeLU is a custom autograd.Function: the sequence says so in its notes."""
    model, args, kwargs = build("bloom")
    seq = autopipe.flatten(model.train(), args, kwargs)
    assert any("GeLUFunction" in note for note in seq.notes)


def test_in_place_op_on_a_stage_input() -> None:
    """ReLU(inplace=True) first in a stage whose input is a leaf requiring grad (as a pipeline engine
    hands it over): the layer writes into a copy, and outputs and gradients equal the model's."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2))
    x = torch.randn(3, 4)
    model(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    expected = model(x).detach()
    model.zero_grad(set_to_none=True)
    first, second = autopipe.flatten(model, (x,)).split([0, 1, 3])
    h = first(x)
    received = h.detach().requires_grad_()  # what the next rank gets
    out = second(received)
    out.sum().backward()
    h.backward(received.grad)
    torch.testing.assert_close(out, expected)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[name], msg=name)


def test_trace_checks_inside_an_autocast_region_are_taken_out() -> None:
    """torch <= 2.11's export leaves dtype checks (``_assert_tensor_metadata``) inside higher-order
    ops' subgraphs (Llama's rotary tables, traced in fp32 in an autocast-off region); under a bf16
    autocast the layer then failed ("Tensor dtype mismatch! Expected: Float") on an H200. torch 2.13
    no longer emits them there, so the subgraph is built here as 2.11 traced it."""
    import torch.fx as fx

    from autopipe.graph.flattener import without_trace_checks

    inner = fx.Graph()
    x = inner.placeholder("x")
    inner.call_function(torch.ops.aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
    inner.output(inner.call_function(torch.ops.aten.mul.Tensor, (x, 2.0)))
    outer = fx.Graph()
    y = outer.placeholder("y")
    outer.output(outer.call_module("region", (y,)))
    bf16 = torch.ones(3, dtype=torch.bfloat16)

    def layer() -> fx.GraphModule:
        root = torch.nn.Module()
        root.region = fx.GraphModule(torch.nn.Module(), inner)
        return fx.GraphModule(root, outer)

    with pytest.raises(RuntimeError, match="dtype"):  # as traced: the region refuses bf16
        layer()(bf16)
    checked = without_trace_checks(layer())
    assert torch.equal(checked(bf16), bf16 * 2)
    assert not any(n.target is torch.ops.aten._assert_tensor_metadata.default
                   for m in checked.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes)


class _Fp32Region(nn.Module):
    """A region autocast leaves alone, on the batch (Llama's rotary region, where it is batch-dependent)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            y = x.float() * 2
        return y + 1


def test_every_higher_order_subgraph_a_layer_holds_goes_through_the_check_removal(monkeypatch) -> None:
    """The flattener hands each autocast / no-grad subgraph a layer holds to ``without_trace_checks``
    as it copies it in (the test above checks what that does)."""
    import torch.fx as fx

    from autopipe.graph import flattener

    seen: list[object] = []
    real = flattener.without_trace_checks
    monkeypatch.setattr(flattener, "without_trace_checks", lambda m: seen.append(m) or real(m))
    seq = autopipe.flatten(nn.Sequential(nn.Linear(4, 4), _Fp32Region(), nn.Linear(4, 2)), (torch.randn(2, 4),))
    held = [getattr(layer, n.target) for layer in seq.layers for n in layer.graph.nodes
            if n.op == "get_attr" and isinstance(getattr(layer, n.target, None), fx.GraphModule)]
    assert held and all(any(m is s for s in seen) for m in held)


def test_layers_record_source_lines_only_when_asked() -> None:
    """flatten leaves torch's per-node stack out (16-30 % of a trace); stack_traces=True keeps
    it, naming the model's own line, which a failing rank's report reads (test_zoo's one-line error)."""
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))  # the line the recorded stacks name

    x = torch.randn(2, 4)
    lean = autopipe.flatten(Net(), (x,), granularity="leaf")
    full = autopipe.flatten(Net(), (x,), granularity="leaf", stack_traces=True)
    stacks = [n.meta.get("stack_trace") for layer in lean.layers for n in layer.graph.nodes]
    assert not any(stacks), stacks
    named = [n.meta.get("stack_trace") or "" for layer in full.layers for n in layer.graph.nodes]
    assert any("return self.b(torch.relu(self.a(x)))" in s for s in named), named
    assert [n.name for layer in lean.layers for n in layer.graph.nodes] == \
        [n.name for layer in full.layers for n in layer.graph.nodes]  # how the failing rank finds its node again
