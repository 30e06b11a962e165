"""A plan's tensor-parallel degree reaches each engine as the engine itself reads it.

- torchtitan 0.3: its ConfigManager reads ``tensor_parallel_degree`` and ``enable_sequence_parallel``
  from the exported module (and the printed overrides give the same); its ParallelDims accepts the
  plan's world (it asserts dp × tp × pp = world); on a fake world of that size torchtitan's own
  Llama3 ``parallelize`` shards each projection by the plan's degree and its splitter still gives each
  pipeline rank the plan's parts.
- Megatron-Core: its parallel_state, on a fake world of the plan's size, lays out tp × pp × dp from
  the exported sizes and finds the plan's data-parallel degree; its micro-batch calculator finds the
  plan's micro-batch count from the exported batch flags; its TransformerConfig takes the tp and
  sequence-parallel flags with the model's head count (and refuses a head count tp does not divide).
- DeepSpeed: its pipeline engine takes no tensor parallelism: the export refuses in one line.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _titan_check import build_model, parse_config, parse_module, split_per_rank, units_of_core_chunk
from test_export_megatron import _flags
from test_export_torchtitan import _check_parts, _chunks_as_planned, _plan

from autopipe import Profile, partition
from autopipe.errors import ExportError
from autopipe.job.export import export_plan

pytestmark = pytest.mark.slow  # torchtitan's and Megatron's imports take seconds

ROOT = Path(__file__).resolve().parent.parent
LLAMA = Profile.load(ROOT / "profiles" / "llama-7b-h100-estimate.json")


def _fake_world(size: int, rank: int = 0) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=size, store=FakeStore())


def test_torchtitan_reads_the_plans_tp_and_shards_its_own_llama3_by_it(tmp_path: Path) -> None:
    spec = "torchtitan:llama3:debugmodel"
    prof, plan = _plan(spec, 2, "1f1b", {2: 3.0})
    plan = dataclasses.replace(plan, tp=2, sequence_parallel=True, dp=2)
    path = tmp_path / "llama3_tp.py"
    out = export_plan(plan, prof, "torchtitan@0.3", path=path)
    path.write_text(out.text)
    assert "--nproc-per-node 8" in out.command
    cfg = parse_module(path)
    again = parse_config(["--module", "llama3", "--config", "llama3_debugmodel", *out.args])
    assert cfg.parallelism == again.parallelism
    p = cfg.parallelism
    assert (p.tensor_parallel_degree, p.enable_sequence_parallel, p.pipeline_parallel_degree) == (2, True, 2)

    from torchtitan.distributed import ParallelDims

    assert ParallelDims.from_config(p, plan.world).tp == 2
    with pytest.raises(AssertionError):  # the check that can fail: torchtitan's own, on a world the plan is not for
        ParallelDims.from_config(p, plan.world // 2 * 3)

    model = build_model(cfg)
    whole = {n: tuple(t.shape) for n, t in model.named_parameters()}
    _check_parts(split_per_rank(model, cfg), plan, _chunks_as_planned(prof, plan), units_of_core_chunk)
    _fake_world(plan.world)
    try:
        dims = ParallelDims.from_config(p, plan.world)
        dims.build_mesh()
        model.parallelize(dims)  # torchtitan's own tensor parallelism, as its trainer applies it
        local = {n: tuple(getattr(t, "_local_tensor", t).shape) for n, t in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    wqkv = "layers.0.attention.qkv_linear.wqkv.weight"
    wo, w2 = "layers.0.attention.wo.weight", "layers.0.feed_forward.w2.weight"
    assert local[wqkv] == (whole[wqkv][0] // 2, whole[wqkv][1])  # column-parallel: output rows split
    assert local[wo] == (whole[wo][0], whole[wo][1] // 2) and local[w2] == (whole[w2][0], whole[w2][1] // 2)


def test_torchtitan_is_told_sequence_parallel_off_when_the_plan_priced_it_off(tmp_path: Path) -> None:
    prof, plan = _plan("torchtitan:llama3:debugmodel", 2, "1f1b", {})
    for tp, sp, want in ((2, False, False), (1, False, None)):
        out = export_plan(dataclasses.replace(plan, tp=tp, sequence_parallel=sp), prof, "torchtitan@0.3",
                          path=tmp_path / f"llama3_tp{tp}.py")  # fmt: skip
        cfg = parse_config(["--module", "llama3", "--config", "llama3_debugmodel", "--training.disable_cuda_graphs",
                            *out.args])  # fmt: skip
        assert cfg.parallelism.tensor_parallel_degree == tp
        assert ("enable_sequence_parallel" in " ".join(out.args)) == (want is not None)
        if want is not None:
            assert cfg.parallelism.enable_sequence_parallel is want


@pytest.mark.parametrize("tp,sp,dp", [(2, True, 2), (8, False, 1), (4, True, 4)])
def test_megatron_lays_out_the_plans_tp_pp_and_dp_from_the_exported_flags(tp: int, sp: bool, dp: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
        from megatron.core.num_microbatches_calculator import (
            destroy_num_microbatches_calculator,
            get_num_microbatches,
            init_num_microbatches_calculator,
        )
        from megatron.core.transformer.transformer_config import TransformerConfig

    plan = partition(LLAMA, 4, schedule="1f1b", target="megatron", memory_limit=None, microbatches=8)
    plan = dataclasses.replace(plan, tp=tp, sequence_parallel=sp, dp=dp)
    flags = _flags(export_plan(plan, LLAMA, "megatron").text)
    size, pp = int(flags["--tensor-model-parallel-size"]), int(flags["--pipeline-model-parallel-size"])
    assert (size, pp, "--sequence-parallel" in flags) == (tp, 4, sp)
    _fake_world(plan.world, rank=plan.world - 1)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=size, pipeline_model_parallel_size=pp,
                                     create_gloo_process_groups=False)  # fmt: skip
        assert ps.get_data_parallel_world_size() == plan.dp
        assert len(dist.get_process_group_ranks(ps.get_tensor_model_parallel_group())) == tp
        init_num_microbatches_calculator(0, None, int(flags["--global-batch-size"]), int(flags["--micro-batch-size"]),
                                         ps.get_data_parallel_world_size())  # fmt: skip
        assert get_num_microbatches() == plan.microbatches
    finally:
        destroy_num_microbatches_calculator()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    heads = 32  # Llama 7B's, the profile's model
    TransformerConfig(num_layers=int(flags["--num-layers"]), hidden_size=4096, num_attention_heads=heads,
                      tensor_model_parallel_size=size, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                      pipeline_dtype=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="num_attention_heads"):  # Megatron's own check, failing where tp does not divide
        TransformerConfig(num_layers=int(flags["--num-layers"]), hidden_size=4096, num_attention_heads=heads + tp // 2,
                          tensor_model_parallel_size=size, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                          pipeline_dtype=torch.float32)  # fmt: skip


def test_deepspeed_export_refuses_tensor_parallelism_in_one_line() -> None:
    plan = partition(LLAMA, 4, schedule="1f1b", target="deepspeed", memory_limit=None)
    export_plan(plan, LLAMA, "deepspeed")  # tp 1: as before
    with pytest.raises(ExportError) as e:
        export_plan(dataclasses.replace(plan, tp=2), LLAMA, "deepspeed")
    msg = str(e.value)
    assert "\n" not in msg and "--tp 1" in msg and "tensor parallelism" in msg, msg
