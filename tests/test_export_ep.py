"""A plan's expert-parallel degree reaches each engine as the engine itself reads it.

- torchtitan 0.3: its ConfigManager reads ``expert_parallel_degree`` from the exported module (and the
  printed overrides give the same); its ParallelDims accepts the plan's world with that ep, and on a
  fake world of the plan's size torchtitan's own Qwen3-MoE ``parallelize`` holds 1/ep of each MoE
  layer's experts per rank.
- Megatron-Core: its parallel_state, on a fake world of the plan's size, makes expert groups of the
  exported ``--expert-model-parallel-size`` (at tp 1 ep consecutive replicas, as the plan's ep group
  is), each expert whole on its rank (with tp, the exported ``--expert-tensor-parallel-size 1``: the
  plan keeps experts whole over tp, at ep 1 too); its TransformerConfig takes the exported expert flags.
- DeepSpeed: its pipeline engine has no expert parallelism: the export refuses in one line.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _titan_check import build_model, parse_config
from test_export_megatron import _flags
from test_export_torchtitan import _plan
from test_export_tp import LLAMA, _fake_world

from autopipe import Profile, partition
from autopipe.costs.layer_costs import MoeShape
from autopipe.errors import ExportError
from autopipe.job.export import export_plan

pytestmark = pytest.mark.slow  # torchtitan's and Megatron's imports take seconds


def _with_experts(prof: Profile, experts: int, top_k: int) -> Profile:
    """The decoder layers recorded as MoE layers of ``experts`` (what moe_shape records on HF models)."""
    shape = MoeShape(experts=experts, top_k=top_k, hidden=8, tokens=64, dispatch_bytes=64 * top_k * 8 * 4,
                     expert_param_share=0.9, expert_forward_share=0.8)  # fmt: skip
    return prof.with_layers([dataclasses.replace(l, moe=shape) if ".layers." in f".{l.name}" or l.name.startswith("layers.")
                             else l for l in prof.layers])  # fmt: skip


def test_torchtitan_reads_the_plans_ep_and_shards_its_own_qwen3_moe_experts_by_it(tmp_path: Path) -> None:
    spec = "torchtitan:qwen3:debugmodel_moe"  # 64 experts, top 8
    prof, plan = _plan(spec, 2, "1f1b", {})
    prof = _with_experts(prof, 64, 8)
    plan = dataclasses.replace(plan, dp=4, ep=4, zero=3)
    out = export_plan(plan, prof, "torchtitan@0.3", path=tmp_path / "qwen3_ep.py")
    assert "cfg.parallelism.expert_parallel_degree = 4" in out.text
    # the overrides on torchtitan's own Qwen3-MoE config function (the module's base names none: that
    # flavour's function is not named after it)
    cfg = parse_config(["--module", "qwen3", "--config", "qwen3_moe_debug", *out.args])
    p = cfg.parallelism
    assert (p.expert_parallel_degree, p.data_parallel_shard_degree, p.pipeline_parallel_degree) == (4, 4, 2)

    from torchtitan.distributed import ParallelDims

    assert ParallelDims.from_config(p, plan.world).ep == 4
    model = build_model(cfg)
    name = next(n for n, _ in model.named_parameters() if "experts" in n and n.startswith("layers.0."))
    whole = dict(model.named_parameters())[name].shape
    _fake_world(plan.world)
    try:
        dims = ParallelDims.from_config(p, plan.world)
        dims.build_mesh()
        assert dims.get_mesh("ep").size() == 4
        model.parallelize(dims)  # torchtitan's own expert parallelism, as its trainer applies it
        held = dict(model.named_parameters())[name]
        local = getattr(held, "_local_tensor", held).shape  # spmd_types keeps the local shard as the parameter
    finally:
        dist.destroy_process_group()
    assert whole[0] == 64 and local[0] == 64 // 4 and tuple(local[1:]) == tuple(whole[1:])


def test_torchtitan_refuses_ep_without_sharded_replicas(tmp_path: Path) -> None:
    prof, plan = _plan("torchtitan:qwen3:debugmodel_moe", 2, "1f1b", {})
    prof = _with_experts(prof, 64, 8)
    with pytest.raises(ExportError) as e:
        export_plan(dataclasses.replace(plan, dp=4, ep=4, zero=0), prof, "torchtitan@0.3", path=tmp_path / "x.py")
    assert "\n" not in str(e.value) and "--zero 2 or 3" in str(e.value)


@pytest.mark.parametrize("tp,dp,ep", [(1, 4, 4), (2, 4, 2), (2, 8, 8), (2, 4, 1)])
def test_megatron_makes_expert_groups_of_the_plans_ep(tp: int, dp: int, ep: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.transformer_config import TransformerConfig

    prof = _with_experts(LLAMA, 8, 2)
    plan = partition(prof, 4, schedule="1f1b", target="megatron", memory_limit=None, microbatches=8)
    plan = dataclasses.replace(plan, tp=tp, dp=dp, ep=ep)
    flags = _flags(export_plan(plan, prof, "megatron").text)
    size, pp = int(flags["--tensor-model-parallel-size"]), int(flags["--pipeline-model-parallel-size"])
    emp, experts, k = (int(flags[f]) for f in ("--expert-model-parallel-size", "--num-experts", "--moe-router-topk"))
    assert (emp, experts, k) == (ep, 8, 2)
    # the plan keeps each expert whole on a tp rank (at ep 1 too: the experts run whole beside the sharded attention)
    etp = int(flags["--expert-tensor-parallel-size"]) if tp > 1 else None
    assert etp in (None, 1) and ("--expert-tensor-parallel-size" in flags) == (tp > 1)
    rank = plan.world - 1
    _fake_world(plan.world, rank=rank)
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=size, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=emp, expert_tensor_parallel_size=etp,
                                     create_gloo_process_groups=False)  # fmt: skip
        assert ps.get_expert_model_parallel_world_size() == ep
        assert ps.get_expert_tensor_parallel_world_size() == 1  # every expert whole on its rank, as planned
        group = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
        assert len(group) == ep, group
        if tp == 1:  # ep consecutive data-parallel replicas
            assert all(b - a == 1 for a, b in zip(group, group[1:])), group
        assert ps.get_data_parallel_world_size() == dp
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    TransformerConfig(num_layers=int(flags["--num-layers"]), hidden_size=4096, num_attention_heads=32,
                      tensor_model_parallel_size=size, pipeline_model_parallel_size=pp, expert_model_parallel_size=emp,
                      num_moe_experts=experts, moe_router_topk=k, moe_ffn_hidden_size=1024, add_bias_linear=False,
                      pipeline_dtype=torch.float32)  # fmt: skip
    with pytest.raises(ValueError, match="num_moe_experts"):  # Megatron's own check: ep without the experts flag
        TransformerConfig(num_layers=int(flags["--num-layers"]), hidden_size=4096, num_attention_heads=32,
                          tensor_model_parallel_size=size, pipeline_model_parallel_size=pp,
                          expert_model_parallel_size=emp if emp > 1 else 2, pipeline_dtype=torch.float32)  # fmt: skip


def test_deepspeed_export_refuses_expert_parallelism_in_one_line() -> None:
    prof = _with_experts(LLAMA, 8, 2)
    plan = partition(prof, 4, schedule="1f1b", target="deepspeed", memory_limit=None)
    export_plan(dataclasses.replace(plan, dp=2), prof, "deepspeed")  # ep 1: as before
    with pytest.raises(ExportError) as e:
        export_plan(dataclasses.replace(plan, dp=2, ep=2), prof, "deepspeed")
    msg = str(e.value)
    assert "\n" not in msg and "--ep 1" in msg and "expert parallelism" in msg, msg
