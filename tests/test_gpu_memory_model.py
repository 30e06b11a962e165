"""The CUDA memory model (issue 22): per-GPU terms beside the tensors, term by term, and what
``--memory-limit device`` leaves the tensors. Figures and their sources: autopipe/costs/gpu_memory.py."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import autopipe
from autopipe.costs.gpu_memory import CUDA_MEMORY, cuda_memory
from autopipe.costs.layer_costs import DeviceInfo, Profile
from autopipe.errors import InfeasibleMemoryError
from autopipe.planner.memory import layer_memory, rank_memory, tensor_budget

MIB = 2**20
GPU = DeviceInfo(name="test GPU", type="cuda", memory_bytes=4000 * MIB, context_bytes=500 * MIB,
                 workspace_bytes=64 * MIB, nccl_group_bytes=700 * MIB, nccl_pair_bytes=550 * MIB,
                 nccl_peer_bytes=100 * MIB, allocator_slack=0.1)  # fmt: skip


def _profile(n: int = 8, device: DeviceInfo = GPU, tied: bool = True, param_mib: int = 40) -> Profile:
    """n layers of 40 MiB parameters (AdamW), 20 MiB activations; layers 0 and n-1 share a 40 MiB tensor."""
    prof = Profile.from_costs([1.0] * n, param_bytes=[param_mib * MIB] * n, activation_bytes=[20 * MIB] * n,
                              output_bytes=[MIB] * n)  # fmt: skip
    if tied:
        layers = list(prof.layers)
        for i in (0, n - 1):
            layers[i] = replace(layers[i], tied=("wte",))
        prof = replace(prof, layers=tuple(layers), tied_static_bytes={"wte": 160 * MIB})
    return replace(prof, device=device)


def test_every_gpu_figure_says_where_it_comes_from() -> None:
    """Each known GPU's row has every term, each published, reported or assumed with a reason."""
    for key, row in CUDA_MEMORY.items():
        for name, figure in row.figures().items():
            assert figure.source in ("published", "reported", "assumed"), (key, name)
            assert figure.why and (figure.bytes > 0 or figure.ratio > 0), (key, name)
    assert cuda_memory("NVIDIA H100 80GB HBM3").workspace.bytes == 64 * MIB  # torch's 32 MiB on sm90, twice
    assert cuda_memory("NVIDIA A100-SXM4-80GB").workspace.bytes < 20 * MIB


def test_a_gpu_profile_carries_its_gpu_s_figures() -> None:
    """An estimate for an H100 carries the H100 row; a CPU device none."""
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    seq = autopipe.flatten(model, (torch.randn(2, 8),))
    prof = autopipe.profile(seq, (torch.randn(2, 8),), estimate=True, device="h100", progress=False)
    h100 = CUDA_MEMORY["h100"]
    assert (prof.device.context_bytes, prof.device.workspace_bytes, prof.device.nccl_peer_bytes) == (
        h100.context.bytes, h100.workspace.bytes, h100.nccl_peer.bytes)
    assert prof.device.allocator_slack == h100.slack.ratio
    cpu = autopipe.profile(seq, (torch.randn(2, 8),), estimate=True, device="cpu", progress=False)
    assert cpu.device.context_bytes == 0 and cpu.device.allocator_slack == 0


def test_each_rank_is_charged_its_context_workspaces_nccl_and_slack() -> None:
    """4 stages x 2 replicas: every rank has the world's, the pipeline's and the replicas'
    communicators; the end ranks also share the tied tensor's (a 2-rank group) and have one
    pipeline neighbour, the middle ranks two. The slack is a tenth of each rank's tensors."""
    prof = _profile()
    ranks = rank_memory(prof, (0, 2, 4, 6, 8), stage_ranks=(0, 1, 2, 3), inflight=(4, 3, 2, 1), microbatches=8, dp=2)
    ends = 700 * MIB + 700 * MIB + 550 * MIB  # world (8 ranks), pipeline (4), replicas (2 ranks: a pair)
    assert ranks[0].nccl == ends + 550 * MIB + 1 * 100 * MIB  # + the tied pair, one neighbour
    assert ranks[1].nccl == ends + 2 * 100 * MIB
    assert ranks[3].nccl == ranks[0].nccl
    for r in ranks:
        assert (r.context, r.workspace) == (500 * MIB, 64 * MIB)
        assert r.allocator == -(-r.tensors // 10)
        assert r.total == r.tensors + r.allocator + r.context + r.workspace + r.nccl + r.reserve


def test_one_rank_alone_has_no_nccl_and_a_cpu_none_of_the_gpu_terms() -> None:
    (alone,) = rank_memory(_profile(), (0, 8), stage_ranks=(0,), inflight=(1,), microbatches=1)
    assert alone.nccl == 0 and alone.context == 500 * MIB
    cpu = _profile(device=DeviceInfo())
    (plain,) = rank_memory(cpu, (0, 8), stage_ranks=(0,), inflight=(1,), microbatches=1)
    assert (plain.context, plain.workspace, plain.nccl, plain.allocator) == (0, 0, 0, 0)
    assert plain.total == plain.tensors + plain.reserve


def test_the_device_limit_is_what_the_tensors_may_use_after_the_fixed_terms() -> None:
    """``--memory-limit device``: the GPU's 4000 MiB less the fixed terms of the busiest rank (context,
    workspace, NCCL) over one plus the slack is the tensors' budget; every rank of the plan fits the
    device in the model's exact bytes, and a cut that fits the raw limit but not the budget is refused."""
    prof = _profile()
    lm = layer_memory(prof, dp=2)
    fixed = 500 * MIB + 64 * MIB + (700 + 700 + 550 + 550) * MIB + 2 * 100 * MIB
    assert tensor_budget(lm, 4000 * MIB, stages=4) == int((4000 * MIB - fixed) // 1.1)
    plan = autopipe.partition(prof, 4, microbatches=8, dp=2, memory_limit="device", bandwidth=None)
    assert plan.memory_limit == 4000 * MIB and plan.memory_limit_source == "device"
    assert all(total <= 4000 * MIB for total in plan.rank_memory)
    # layers of 100 MiB parameters, two stages of 4: 4 x 400 MiB static, 400 MiB of AdamW's step
    # temporaries: about 2000 MiB of tensors per rank, under the 4000 MiB alone, over it with the GPU's terms
    heavy = _profile(param_mib=100)
    with pytest.raises(InfeasibleMemoryError, match="fits"):
        autopipe.partition(heavy, 2, microbatches=2, dp=2, memory_limit="device", bandwidth=None, recompute="none")
    bare = replace(GPU, context_bytes=0, workspace_bytes=0, nccl_group_bytes=0, nccl_pair_bytes=0, nccl_peer_bytes=0,
                   allocator_slack=0.0)  # fmt: skip
    tensors_only = autopipe.partition(replace(heavy, device=bare), 2, microbatches=2, dp=2, memory_limit="device",
                                      bandwidth=None, recompute="none")  # fmt: skip
    assert tensors_only.peak_memory <= 4000 * MIB


def test_a_limit_below_the_fixed_terms_says_what_the_runtime_holds() -> None:
    with pytest.raises(InfeasibleMemoryError, match="leaves nothing for the model.*context"):
        autopipe.partition(_profile(), 4, microbatches=8, dp=2, memory_limit="2GiB", bandwidth=None)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=4, max_size=9), st.integers(1, 3), st.integers(2, 4),
       st.sampled_from(["1f1b", "gpipe", "zbv"]), st.integers(3000, 9000))
def test_gpu_plans_never_exceed_the_device(params, dp, stages, schedule, limit_mib) -> None:
    """Whatever the layout, a plan under a GPU profile fits the limit with every term counted."""
    n = len(params)
    if stages * (2 if schedule == "zbv" else 1) > n:
        return
    prof = replace(Profile.from_costs([1.0] * n, param_bytes=[p * MIB for p in params],
                                      activation_bytes=[5 * MIB] * n, output_bytes=[MIB] * n), device=GPU)  # fmt: skip
    try:
        plan = autopipe.partition(prof, stages, microbatches=2 * stages, dp=dp, schedule=schedule,
                                  memory_limit=limit_mib * MIB, bandwidth=None)  # fmt: skip
    except InfeasibleMemoryError:
        return
    assert max(plan.rank_memory) <= limit_mib * MIB
