"""Megatron-Core itself reads the layout `autopipe export --to megatron` writes.

megatron-core's PipelineParallelLayerLayout parses and validates each exported
``--pipeline-model-parallel-layout`` against ``--num-layers``; per pipeline rank and virtual stage its
``get_layer_id_list`` gives the plan's decoder layers (chunk ``v * pp + r``), with the embedding (E)
on the first chunk and the loss (L) on the last; and the functions Megatron's TransformerBlock calls
to build its layers (``get_num_layers_to_build``, ``get_transformer_layer_offset``) agree from a
TransformerConfig holding the layout. Random stage lists written by autopipe round-trip through
Megatron's parser.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe import Profile, partition
from autopipe.job.export import export_plan
from autopipe.job.export.megatron import megatron_layout
from autopipe.planner.targets import decoder_stack

pytestmark = pytest.mark.slow  # importing megatron.core takes seconds

ROOT = Path(__file__).resolve().parent.parent
GPT2 = Profile.load(ROOT / "profiles" / "gpt2-cpu.json")
LLAMA = Profile.load(ROOT / "profiles" / "llama-7b-h100-estimate.json")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout


def _flags(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        key, _, value = line.strip().partition(" ")
        if key.startswith("--"):
            out[key] = value.strip('"')
    return out


def _planned_layers(prof: Profile, plan: object) -> list[list[int]]:
    """Per chunk, the decoder layer ids (Megatron's numbering: 0.. over the stack) the plan gives it."""
    blocks = decoder_stack([layer.name for layer in prof.layers]).blocks
    first = [sum(blocks[:i]) for i in range(len(blocks) + 1)]
    return [list(range(first[a], first[b])) for a, b in zip(plan.boundaries, plan.boundaries[1:])]


@pytest.fixture
def vpp_world():
    """Megatron reads the virtual-stage count from its global state: set it per layout, then clear it."""
    yield parallel_state.set_virtual_pipeline_model_parallel_world_size
    parallel_state.set_virtual_pipeline_model_parallel_world_size(None)
    parallel_state.set_pipeline_model_parallel_rank(None)


@pytest.mark.parametrize("prof,stages,schedule", [(LLAMA, 4, "1f1b"), (LLAMA, 4, "interleaved1f1b"), (GPT2, 4, "1f1b"),
                                                  (LLAMA, 8, "interleaved1f1b"), (GPT2, 2, "interleaved1f1b")])
def test_megatrons_parser_gives_each_rank_and_virtual_stage_the_plans_layers(prof: Profile, stages: int, schedule: str,
                                                                            vpp_world) -> None:  # noqa: ANN001
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    plan = partition(prof, stages, schedule=schedule, target="megatron", memory_limit=None)
    flags = _flags(export_plan(plan, prof, "megatron").text)
    pp, layers, text = int(flags["--pipeline-model-parallel-size"]), int(flags["--num-layers"]), flags["--pipeline-model-parallel-layout"]
    layout = PipelineParallelLayerLayout(text, pp)
    layout.validate_layer_layout(num_layers=layers, mtp_num_layers=None)
    vpp = layout.virtual_pipeline_model_parallel_size
    assert pp == plan.stages and vpp == plan.virtual_stages
    vpp_world(vpp if vpp > 1 else None)
    config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                               pipeline_model_parallel_layout=text, pipeline_dtype=torch.bfloat16)  # fmt: skip
    want = _planned_layers(prof, plan)
    for v in range(vpp):
        for r in range(pp):
            c = v * pp + r  # Megatron's chunk order: virtual stage v of rank r
            assert plan.stage_ranks[c] == r
            assert layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=v, pp_rank=r) == want[c]
            assert (LayerType.embedding in layout.layout[r][v]) == (c == 0)
            assert (LayerType.loss in layout.layout[r][v]) == (c == plan.num_chunks - 1)
            parallel_state.set_pipeline_model_parallel_rank(r)
            vs = v if vpp > 1 else None
            n = get_num_layers_to_build(config, vp_stage=vs, pp_rank=r)
            offset = get_transformer_layer_offset(config, vp_stage=vs, pp_rank=r)
            assert list(range(offset, offset + n)) == want[c]


def test_two_blocks_per_flattened_layer_count_as_two_decoder_layers() -> None:
    from test_export import _profile

    two = _profile(["wte, wpe", "h.0..h.1", "h.2..h.3", "ln_f", "lm_head"])
    plan = partition(two, 2, target="megatron", bandwidth=None)
    flags = _flags(export_plan(plan, two, "megatron").text)
    layout = PipelineParallelLayerLayout(flags["--pipeline-model-parallel-layout"], 2)
    layout.validate_layer_layout(num_layers=int(flags["--num-layers"]), mtp_num_layers=None)
    assert [layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=0, pp_rank=r) for r in range(2)] == \
        _planned_layers(two, plan)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=2, max_size=12), st.sampled_from([1, 2]))
def test_any_stage_list_round_trips_through_megatrons_parser(decoder: list[int], per_rank: int) -> None:
    """Runs of equal stages are grouped ("(t*4|)*3"); Megatron reads back every stage as written."""
    n = len(decoder) - len(decoder) % per_rank or per_rank
    symbols = [(int(i == 0), t, int(i == n - 1)) for i, t in enumerate((decoder * 2)[:n])]
    layout = PipelineParallelLayerLayout(megatron_layout(symbols), n // per_rank)
    pp = n // per_rank
    for i, (e, t, loss) in enumerate(symbols):
        got = layout.layout[i % pp][i // pp]
        assert got.count(LayerType.decoder) == t
        assert (LayerType.embedding in got, LayerType.loss in got) == (bool(e), bool(loss))
