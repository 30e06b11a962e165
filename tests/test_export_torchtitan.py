"""torchtitan 0.3 itself reads what `autopipe export --to torchtitan` writes, and splits the model as planned.

For each model a plan is made for torchtitan (layer costs chosen so the best cut is not torchtitan's
even split), exported, and handed to torchtitan's own code (tests/_titan_check.py calls it): its
ConfigManager reads the exported config module (and the printed overrides on top of the model's own
config give the same), its builder makes the model from that config on meta, and its splitter (the
one the model's pipelining function calls) builds each pipeline rank's parts on a fake process group.
Each part must hold exactly the plan's chunk, on the rank the plan put it, every parameter once:

- a HuggingFace Llama through torchtitan's HuggingFace backend (the export renames its modules);
- torchtitan's own Llama3, whose parts, run one after another, give the whole model's logits;
- torchtitan's own Qwen3, untied (torchtitan refuses tied weights under pipeline parallelism).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _titan_check import build_model, parse_config, parse_module, split_per_rank, units_of_core_chunk, units_of_hf_chunk

import autopipe
from autopipe import Profile, partition
from autopipe.costs.layer_costs import LayerCost
from autopipe.errors import PartitionError
from autopipe.graph.sources import load_model
from autopipe.job.export import export_plan
from autopipe.planner.targets import layer_units

pytestmark = pytest.mark.slow  # torchtitan's imports alone take seconds

HF_NAMES = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "lm_head"}


def _plan(spec: str, stages: int, schedule: str, heavy: dict[int, float], **options: object) -> tuple[Profile, object]:
    """A profile of the model as autopipe flattens it (costs given: ``heavy`` layers cost more), planned for torchtitan."""
    ms = load_model(spec, device="meta", batch_size=2, seq_len=32)
    seq = autopipe.flatten(ms.model, ms.args, ms.kwargs)
    names = [info.name for info in seq.infos]
    tied = {i: tuple(g.canonical for g in seq.tied if i in g.layers) for i in range(len(names))}
    prof = Profile(layers=tuple(LayerCost(i, n, heavy.get(i, 1.0) / 3, 2 * heavy.get(i, 1.0) / 3, params=10,
                                          tied=tied[i]) for i, n in enumerate(names)),
                   signature=seq.signature, model=spec, microbatch={"input_ids": [2, 32]})  # fmt: skip
    return prof, partition(prof, stages, schedule=schedule, microbatches=4, target="torchtitan", bandwidth=None,
                           **options)  # fmt: skip


def _chunks_as_planned(prof: Profile, plan: object, rename: dict[str, str] | None = None) -> list[list[str]]:
    """Per chunk, the modules of its layers (parameter holders), in torchtitan's names."""
    out = []
    for c in range(plan.num_chunks):
        units = [u for i in plan.layers_of(c) for u in layer_units(prof.layers[i].name)]
        out.append([(rename or {}).get(u, u.removeprefix("model.")) for u in units if u != "model.rotary_emb"])
    return out


def _check_parts(split: dict[int, list], plan: object, want: list[list[str]], units_of) -> None:  # noqa: ANN001
    """Every part on the rank the plan gave it, holding exactly its chunk's modules."""
    held = {}
    for rank, pairs in split.items():
        for stage, chunk in pairs:
            assert plan.stage_ranks[stage] == rank, (stage, rank)
            held[stage] = units_of(chunk)
    assert [sorted(held[c]) for c in range(plan.num_chunks)] == [sorted(w) for w in want]


def test_a_huggingface_llama_splits_as_planned_on_torchtitans_hf_backend(tmp_path: Path) -> None:
    """The HF backend's names, its config function with hf_model = the folder, its split: the plan's chunks."""
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

    untouched = (PreTrainedModel._init_weights, PreTrainedModel._initialize_weights,
                 LlamaForCausalLM.__init__)  # fmt: skip

    folder = tmp_path / "tiny-llama"
    LlamaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=48, max_position_embeddings=64, tie_word_embeddings=False,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)  # fmt: skip
    prof, plan = _plan(str(folder), 3, "1f1b", {1: 3.0, 8: 6.0})
    assert plan.boundaries != (0, 3, 5, 9)  # not the even split
    out = export_plan(plan, prof, "torchtitan@0.3", path=tmp_path / "autopipe_plan.py")
    (tmp_path / "autopipe_plan.py").write_text(out.text)
    cfg = parse_module(tmp_path / "autopipe_plan.py")
    assert cfg.hf_model == str(folder.resolve())
    assert all("rotary_emb" in part for part in cfg.parallelism.module_fqns_per_model_part)  # every stage runs it
    model = build_model(cfg)
    split = split_per_rank(model, cfg)
    _check_parts(split, plan, _chunks_as_planned(prof, plan, HF_NAMES), units_of_hf_chunk)
    kept = sum(p.numel() for pairs in split.values() for _, c in pairs for p in c.parameters())
    assert kept == sum(p.numel() for p in model.parameters())
    # the names as the HuggingFace model has them lose almost everything in torchtitan's split, silently
    from torchtitan.distributed.pipeline_parallel import _split_module

    raw = [_split_module(model, list(m)) for m in out.modules.modules]
    assert sum(p.numel() for c in raw for p in c.parameters()) < kept / 2
    # the backend's patches to transformers are undone: later tests' references init as HF does
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    assert (PreTrainedModel._init_weights, PreTrainedModel._initialize_weights,
            LlamaForCausalLM.__init__) == untouched  # fmt: skip
    assert LlamaDecoderLayer.__init__.__qualname__ == "LlamaDecoderLayer.__init__"


def test_torchtitans_llama3_splits_as_planned_and_its_parts_give_the_models_logits(tmp_path: Path) -> None:
    """Interleaved over 2 ranks: the module and the printed overrides read the same; the parts are the plan's."""
    spec = "torchtitan:llama3:debugmodel"
    prof, plan = _plan(spec, 2, "interleaved1f1b", {1: 4.0, 2: 3.0})
    path = tmp_path / "llama3_pp.py"
    out = export_plan(plan, prof, "torchtitan@0.3", path=path)
    path.write_text(out.text)
    cfg = parse_module(path)
    again = parse_config(["--module", "llama3", "--config", "llama3_debugmodel", *out.args])
    assert cfg.parallelism == again.parallelism and cfg.training == again.training
    assert cfg.activation_checkpoint is None and again.activation_checkpoint is None  # written: the default is selective
    p = cfg.parallelism
    assert (p.pipeline_parallel_degree, p.pipeline_parallel_schedule) == (2, "Interleaved1F1B")
    assert cfg.training.local_batch_size // p.pipeline_parallel_microbatch_size == plan.microbatches
    model = build_model(cfg)
    split = split_per_rank(model, cfg)
    _check_parts(split, plan, _chunks_as_planned(prof, plan), units_of_core_chunk)
    held = sorted(n for pairs in split.values() for _, c in pairs for n, _ in c.named_parameters())
    assert held == sorted(n for n, _ in model.named_parameters())  # every parameter in exactly one part

    from torchtitan.distributed.pipeline_parallel import _split_module

    whole = load_model(spec, device="cpu", batch_size=2, seq_len=16).model.eval()  # SDPA: runs on the CPU
    ids = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    x = ids
    with torch.no_grad():
        for part in p.module_fqns_per_model_part:
            x = _split_module(whole, part)(x)
        torch.testing.assert_close(x, whole(ids), atol=1e-5, rtol=0)


def test_torchtitans_qwen3_untied_splits_in_a_v_and_recomputes_as_planned(tmp_path: Path) -> None:
    """ZBVZeroBubble puts parts 0 and 3 on rank 0; the untied config and full recompute reach torchtitan."""
    spec = "torchtitan:qwen3:debugmodel,enable_weight_tying=false"
    prof, plan = _plan(spec, 2, "zbv", {3: 4.0}, recompute="full")
    path = tmp_path / "qwen3_pp.py"
    path.write_text(export_plan(plan, prof, "torchtitan@0.3", path=path).text)
    cfg = parse_module(path)
    from torchtitan.distributed.activation_checkpoint import FullAC

    assert isinstance(cfg.activation_checkpoint, FullAC.Config)
    assert cfg.model_spec.model.enable_weight_tying is False
    model = build_model(cfg)  # torchtitan raises here for a tied model under pipeline parallelism
    split = split_per_rank(model, cfg)
    assert [s for s, _ in split[0]] == [0, 3] and plan.stage_ranks == (0, 1, 1, 0)
    _check_parts(split, plan, _chunks_as_planned(prof, plan), units_of_core_chunk)


def test_a_tied_qwen3_is_refused_in_one_line_as_torchtitan_refuses_it() -> None:
    """Tied tok_embeddings and lm_head: autopipe names the fix; torchtitan's own check refuses the same model."""
    from types import SimpleNamespace

    from torchtitan.config import ParallelismConfig

    with pytest.raises(PartitionError) as e:
        _plan("torchtitan:qwen3:debugmodel", 2, "1f1b", {})
    msg = str(e.value)
    assert "\n" not in msg and "enable_weight_tying=false" in msg, msg
    from autopipe.graph.titan_models import parse_titan_spec, titan_model_config

    config = titan_model_config(parse_titan_spec("torchtitan:qwen3:debugmodel"))
    with pytest.raises(NotImplementedError, match="Weight tying"):
        config.update_from_config(config=SimpleNamespace(parallelism=ParallelismConfig(pipeline_parallel_degree=2)))


@pytest.mark.parametrize("layers,chunks", [(6, 2), (6, 4), (8, 3), (32, 4), (32, 8), (26, 4), (61, 16)])
def test_the_default_split_priced_beside_the_plan_is_torchtitans_own(layers: int, chunks: int) -> None:
    """default_cut("torchtitan") gives each chunk the modules torchtitan's generate_llm_fqn_per_model_part does."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    from autopipe.planner.targets import default_cut

    names = ["tok_embeddings", *(f"layers.{i}" for i in range(layers)), "norm", "lm_head"]
    bounds, _ = default_cut("torchtitan", names, [1.0] * len(names), chunks)
    ours = [names[a:b] for a, b in zip(bounds, bounds[1:])]
    theirs = _generate_llm_fqn_per_model_part(chunks, layers, 1, 1)
    assert ours == theirs
