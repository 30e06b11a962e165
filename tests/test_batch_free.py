"""Values that do not depend on the batch (causal masks, rotary tables) cross no cut: each stage makes them.

The untouched model is the reference: the flattened and split model, with these values made on each
stage, gives its outputs, loss and gradients; what still crosses a cut is only what the batch
changes. Values that depend on a buffer the model writes, on a parameter or on random numbers are
sent as before.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import pytest
import torch
from _launch import Launcher
from archs import B, T, V, _ids, gpt2
from test_flatten import _assert_same, _even, _run, _run_stages
from torch import fx, nn
from torch.utils._python_dispatch import TorchDispatchMode

import autopipe
from autopipe.graph.batch_free import BatchFreeValue, held_tensors
from autopipe.graph.recompute import run_layer


def llama() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A tiny Llama fed token ids alone: its causal mask and rotary tables are functions of constants."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=48, max_position_embeddings=32)
    ids = _ids()
    return LlamaForCausalLM(cfg), (ids,), {"labels": ids, "use_cache": False}


def mistral() -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """A tiny Mistral whose sliding window (3) is shorter than the sequence: its mask is no plain
    causal one, so it stays a traced mask (autopipe.graph.attention) and is made on each stage."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=48, max_position_embeddings=32, sliding_window=3)
    ids = _ids()
    return MistralForCausalLM(cfg), (ids,), {"labels": ids, "use_cache": False}


BUILDERS = {"llama": llama, "gpt2": gpt2, "mistral": mistral}


def _holders(module: nn.Module) -> list[BatchFreeValue]:
    return list({id(m): m for m in module.modules() if isinstance(m, BatchFreeValue)}.values())


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_only_what_the_batch_changes_crosses_a_cut(arch: str) -> None:
    """Every layer after the first takes the labels and the hidden state only: no bool mask, no cos/sin.
    The blocks make them (one holder per value, shared), and the sequence and its 2/3-stage splits
    give the untouched model's outputs, loss and every parameter gradient within 1e-5. A plain
    causal mask is no value at all (SDPA's is_causal: autopipe.graph.attention); Mistral's sliding
    window mask is."""
    model, args, kwargs = BUILDERS[arch]()
    ref = _run(model, lambda: model(*args, **kwargs))
    seq = autopipe.flatten(model, args, kwargs)
    hidden = model.config.hidden_size
    for info in seq.infos[1:]:
        sent = sorted((s.dtype, s.shape) for s in info.inputs)
        assert sent == [("float32", (B, T, hidden)), ("int64", (B, T))], f"{info.name} receives {info.inputs}"
    blocks = [info for info in seq.infos if info.kind != "glue"]
    made = {(s.dtype, s.shape) for info in blocks for s in info.computed}
    head = hidden // model.config.num_attention_heads
    expected = ({("bool", (B, 1, T, T))} if arch == "mistral" else set()) | (
        {("float32", (1, T, head))} if arch != "gpt2" else set())
    assert made == expected, f"{arch} blocks make {made}"
    assert all(len(info.computed) == len(blocks[0].computed) for info in blocks)
    # identical blocks: one structure key, so the profiler measures one of them
    assert len({info.structure for info in blocks[:-1]}) == 1
    # one holder per value however many layers read it
    values = {s.name for info in seq.infos for s in info.computed}
    assert len(_holders(seq)) == len(values)

    _assert_same(ref, _run(model, lambda: seq(*args, **kwargs)), f"{arch} sequence")
    for stages in (2, 3):
        parts = seq.split(_even(len(seq), stages))
        _assert_same(ref, _run(model, lambda: _run_stages(parts, args, kwargs)), f"{arch} {stages} stages")
    assert len(held_tensors(seq)) == len(values)  # a stage keeps one copy of each


def test_bytes_crossing_each_cut_are_the_batch_s_only() -> None:
    """The profile's output bytes of every block are the labels' and the hidden state's; the
    blocks are measured once and reused."""
    model, args, kwargs = gpt2()
    seq = autopipe.flatten(model, args, kwargs)
    prof = autopipe.profile(seq, args, kwargs, warmup=0, repeats=1, progress=False)
    per_cut = B * T * 8 + B * T * model.config.n_embd * 4
    assert [c.output_bytes for c in prof.layers[:-1]] == [per_cut] * (len(seq) - 1)
    assert [c.source for c in prof.layers[1:4]] == ["measured", "reused", "reused"]


class Mixed(nn.Module):
    """Four values every block reads: from a buffer nothing writes, from a counter the forward
    increments, from a parameter, and random; only the first depends on nothing but constants."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("base", torch.arange(8.0))
        self.register_buffer("steps", torch.zeros(()))
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        fixed = torch.cos(self.base)  # (8,) from an unwritten buffer: made on each stage
        warm = torch.sin(self.base * self.steps)  # (1, 8) after the view below: reads the counter
        learned = self.scale.exp()  # (8,) ... but a parameter's
        noise = torch.rand(2, 8)  # random
        warm = warm.view(1, 8)
        for block in self.blocks:
            x = block(x) * warm + fixed + learned * noise
        return x


def test_values_of_written_buffers_parameters_or_random_ops_are_still_sent() -> None:
    """A value read from a buffer the model writes (a step counter), from a parameter, or drawn at
    random crosses the cuts as before; the one from an unwritten buffer is made on each stage. Two
    calls (the counter moves) give the untouched model's outputs and gradients."""
    torch.manual_seed(0)
    model = Mixed()
    x = torch.randn(2, 8)
    seq = autopipe.flatten(model, (x,))
    made = {s.name for info in seq.infos for s in info.computed}
    assert {s.shape for info in seq.infos for s in info.computed} == {(8,)}  # cos of the unwritten buffer
    for info in seq.infos[1:]:
        # the counter () and what it made (1, 8), x and the random draw (2, 8), the parameter's value (8,)
        assert sorted(s.shape for s in info.inputs) == [(), (1, 8), (2, 8), (2, 8), (8,)], f"{info.name}: {info.inputs}"
        assert not made & {s.name for s in info.inputs}
    for _ in range(2):
        torch.manual_seed(1)
        ref = _run(model, lambda: model(x))
        torch.manual_seed(1)
        got = _run(model, lambda: seq(x))
        _assert_same(ref, got, "mixed")
        model.steps += 1  # _run put the counter back; move it as a real step would


def _cos_recipe() -> fx.GraphModule:
    g = fx.Graph()
    g.output(g.call_function(torch.ops.aten.cos.default, (g.placeholder("table"),)))
    return fx.GraphModule(nn.Module(), g)


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_holder_keeps_its_value_until_what_it_read_changes() -> None:
    """The kept value is handed out again until its input is another tensor, is written in place,
    or the autocast state changes; meta and fake values are never kept; it needs no grad; Python
    dispatch modes (selective checkpoint's caches, the profiler's counters) do not see it made;
    a copy of the holder keeps nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    holder = BatchFreeValue(_cos_recipe(), "cos")
    table = torch.arange(4.0)
    with torch.enable_grad():
        first = holder(table)
    assert not first.requires_grad and holder(table) is first
    table.add_(1)  # an in-place write: _version moves
    second = holder(table)
    assert second is not first and torch.equal(second, torch.cos(table))
    other = table.clone()
    kept = holder(other)
    assert kept is not second and holder(other) is kept
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_amp = holder(other)
        assert under_amp is not kept and holder(other) is under_amp
    kept = holder(other)
    assert kept is not under_amp  # autocast left: made again
    assert holder(other.to("meta")).is_meta and holder(other) is kept  # a meta value is handed out, not kept
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = holder(other)
    assert type(fake).__name__ == "FakeTensor" and holder(other) is kept
    fresh = BatchFreeValue(_cos_recipe(), "cos")
    with _Count() as count:
        fresh(other)
    assert count.ops == 0
    assert copy.deepcopy(holder).held() == []


class TableBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # no bias: its product is an mm, like the table's; a recipe's mm that selective recompute's
        # cache saw in the forward but not in the recomputation would be handed to this one
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x * table))


class RopeBlocks(nn.Module):
    """Blocks reading a table made by a matrix product of constants: ``mm``, an operator selective
    recompute keeps, inside the recipe, and before each block's own."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv", torch.linspace(0.1, 1.0, 16))
        self.blocks = nn.ModuleList(TableBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.sin(torch.arange(8.0).view(4, 2) @ self.inv.view(2, 8))  # (4, 8)
        for block in self.blocks:
            x = block(x, table)
        return x


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_recomputed_layer_reads_the_same_table(mode: str) -> None:
    """A block first run under recompute (its table made inside the checkpointed forward, then read
    from the holder in the recomputation) gives the gradients of the untouched model."""
    torch.manual_seed(0)
    model = RopeBlocks()
    x = torch.randn(4, 8)
    ref = _run(model, lambda: model(x))
    seq = autopipe.flatten(model, (x,), validate=False)
    # matmul runs as mm below the Python dispatch key, where selective recompute's cache sees it
    assert any(n.target == torch.ops.aten.matmul.default for h in _holders(seq) for n in h.recipe.graph.nodes)

    def pipelined() -> torch.Tensor:
        y: Any = seq.pack_inputs((x,), {})
        for layer in seq.layers:
            y = run_layer(layer, y, mode)
        return seq.unpack_outputs(y)

    _assert_same(ref, _run(model, pipelined), f"{mode} recompute")


def test_rotary_tables_under_bf16_autocast_equal_the_untouched_model_s() -> None:
    """Under bf16 autocast (as train.py --dtype bf16 runs the layers) the kept cos/sin equal what
    the untouched Llama computes under autocast (HF makes them in fp32 on purpose), and so does the loss."""
    model, args, kwargs = llama()
    seq = autopipe.flatten(model, args, kwargs)
    seq(*args, **kwargs)  # kept once without autocast: autocast must make them again
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = model(*args, **kwargs).loss
        hidden = model.model.embed_tokens(args[0])
        cos, sin = model.model.rotary_emb(hidden, torch.arange(T).unsqueeze(0))
        got_loss = seq(*args, **kwargs).loss
    tables = [t for t in held_tensors(seq) if t.is_floating_point()]
    assert len(tables) == 2 and all(t.dtype == cos.dtype == torch.float32 for t in tables)
    for want in (cos, sin):
        assert sum(torch.equal(t, want) for t in tables) == 1
    torch.testing.assert_close(got_loss, ref_loss)


def _llama_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=48, max_position_embeddings=32)


def _make_llama() -> nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(_llama_config())


def _rotary(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The untouched Llama's own cos and sin for the example's positions."""
    return model.model.rotary_emb(torch.zeros(1, T, 32), torch.arange(T).unsqueeze(0))


def _same_tables(holders: list[BatchFreeValue], expected: tuple[torch.Tensor, ...]) -> None:
    made = [h._value for h in holders]
    assert all(t is not None and t.device.type == "cpu" for t in made), made
    for want in expected:
        assert sum(torch.equal(t, want) for t in made) == 1


def test_a_stage_built_on_meta_makes_its_tables_on_its_device() -> None:
    """build_stage flattens on meta, then materialises this rank's tensors: the holders of its chunk
    make real tables on its device, equal to the untouched model's built with the same seed; the
    chunk holds the buffer they read. A layer run on meta before materialising keeps nothing."""
    from autopipe.graph.sequence import retarget_device_
    from autopipe.runtime.stage.build import build_reference, build_stage, fill_tensors, meta_model, to_meta

    ids = _ids()
    kwargs = {"labels": ids, "use_cache": False}
    b = build_stage(_make_llama, (ids,), kwargs, [0, 3, 7], pp_rank=1, pp_size=2, device="cpu")
    (chunk,) = b.chunks
    holders = _holders(chunk)
    tables = [h for h in holders if h.recipe.graph.find_nodes(op="placeholder")]  # cos, sin: they read inv_freq
    assert len(holders) == 2 and len(tables) == 2  # no mask: SDPA's is_causal (autopipe.graph.attention)
    assert "model.rotary_emb.inv_freq" in {n for layer in chunk.layers for n, _ in layer.named_buffers()}
    first = b.plan.boundaries[b.chunk_ids[0]]
    inputs = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in b.seq.infos[first].inputs]
    chunk(*inputs)
    reference = _rotary(build_reference(_make_llama, seed=0))
    _same_tables(tables, reference)

    # the same steps by hand, with a run on meta first: what it made is not handed out afterwards
    model = meta_model(_make_llama)
    seq = autopipe.flatten(model, to_meta((ids,)), to_meta(kwargs), validate=False, device_type="cpu")
    layer = seq.layers[3]
    layer(tuple(torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device="meta") for s in seq.infos[3].inputs))
    tables = [h for h in _holders(layer) if h.recipe.graph.find_nodes(op="placeholder")]
    assert len(tables) == 2 and all(h._value is None for h in tables)
    names = [n for n, _ in (*layer.named_parameters(), *layer.named_buffers())]
    fill_tensors(model, _make_llama, names, seed=0, weights=None, device="cpu")
    seq.rebind_(model)
    retarget_device_(layer, "cpu")
    layer(tuple(torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in seq.infos[3].inputs))
    _same_tables(tables, reference)


def test_a_deepspeed_layer_file_from_before_loads() -> None:
    """DeepSpeed's strict load takes a layer file written before the blocks made their rotary
    tables: layer 0's copy of inv_freq (it reads none now) is dropped, a block's missing one keeps
    the built value; a missing parameter is still an error."""
    from autopipe.runtime.deepspeed_engine.module import DSLayer, LayerSource

    ids = _ids()
    ctx = LayerSource(_make_llama, (ids,), {"labels": ids, "use_cache": False}, seed=0, weights=None,
                      device=torch.device("cpu"))
    first, block = DSLayer(ctx, 0), DSLayer(ctx, 1)
    key = "layer.model.rotary_emb.inv_freq"
    assert key not in first.state_dict() and key in block.state_dict()
    first.load_state_dict({**first.state_dict(), key: block.state_dict()[key].clone()})  # strict
    built = block.state_dict()[key].clone()
    before = {k: v for k, v in block.state_dict().items() if k != key}
    block.load_state_dict(before)
    assert torch.equal(block.state_dict()[key], built)
    with pytest.raises(RuntimeError, match="Missing key"):
        block.load_state_dict({k: v for k, v in before.items() if "q_proj" not in k})


def test_inspect_lists_what_each_stage_makes() -> None:
    """`autopipe inspect` says which values are made on each stage instead of crossing a cut (Llama's
    rotary tables), and what became of the traced attention (no mask left to make)."""
    from typer.testing import CliRunner

    from autopipe.cli.app import app

    result = CliRunner().invoke(app, ["inspect", "llama-tiny", "--seq-len", "16"], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert "made on each stage, never sent: f32[1,16,32] (layers 1-4), f32[1,16,32] (layers 1-4)" in result.output
    assert "f32[1,16,32]" not in result.output.split("made on each stage")[0]
    assert ("attention: 4 of 4 SDPA calls causal without the traced mask (is_causal), 4 with grouped key/value "
            "heads (enable_gqa)") in result.output
    assert "bool[" not in result.output


# ---- jobs: the untouched model's first step on both engines --------------------------------------

ROWS, MICRO, SEQ, LR, TOL = 2, 2, 16, 1e-3, 1e-5


@pytest.fixture(scope="module")
def llama_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import LlamaConfig

    from autopipe.job.script import write_train_script
    from autopipe.job.settings import JobSettings

    root = tmp_path_factory.mktemp("batch_free")
    LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=48, vocab_size=128, max_position_embeddings=SEQ,
                ).save_pretrained(root / "llama")
    np.random.default_rng(0).integers(0, 128, 4000, dtype=np.uint16).tofile(root / "tokens.bin")
    job = dict(model=str(root / "llama"), data=root / "tokens.bin", loss="auto", dropout=False, root=root)
    (root / "job").mkdir()
    for engine in ("torch", "deepspeed"):
        write_train_script(root / "job" / f"train_{engine}.py", JobSettings(model=job["model"], stages=2, microbatches=MICRO, schedule="1f1b", batch_size=ROWS, seq_len=SEQ, engine=engine, data=str(job["data"])))
    return job


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["torch", pytest.param("deepspeed", marks=pytest.mark.deepspeed)])
def test_a_llama_job_trains_as_the_untouched_model(torchrun: Launcher, llama_job: dict[str, Any], engine: str) -> None:
    """2 stages on 2 processes: the loss of both steps and every gradient of the first equal the
    untouched Llama's (1e-5), with the mask and rotary tables made on each stage, not sent."""
    from test_jobs import launch, reference

    from autopipe.graph.flattener import flatten
    from autopipe.runtime import model_factory
    from autopipe.runtime.stage.build import meta_model

    source = model_factory(llama_job["model"], batch_size=ROWS, seq_len=SEQ)
    seq = flatten(meta_model(source.factory), source.args, source.kwargs, device_type="cpu")
    assert all(info.computed and len(info.inputs) == 2 for info in seq.infos if info.kind != "glue")
    run = launch(torchrun, llama_job, engine)
    ref_losses, _, ref_grads, tensor_of = reference(llama_job)
    log = [json.loads(line) for line in (run / "log.json").read_text().splitlines()]
    assert [r["loss"] for r in log] == pytest.approx(ref_losses, abs=TOL)
    grads: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        grads.update(torch.load(run / f"grads_rank{rank}.pt", weights_only=True))
    for param, g in grads.items():
        torch.testing.assert_close(g, ref_grads[param], atol=TOL, rtol=0, msg=f"llama/{engine}: {param}")
    assert {tensor_of[p] for p in grads} == set(tensor_of.values())
