"""The profile pass on a real HuggingFace GPT-2 (tiny config) and the estimate mode on meta tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import autopipe
from autopipe.costs.devices import KNOWN_DEVICES, device_spec
from autopipe.costs.measure import static_storage_keys, storage_key
from autopipe.errors import AutopipeError

B, T, V, D, LAYERS = 2, 16, 128, 64, 3


def _gpt2(device: str = "cpu"):  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=LAYERS, n_embd=D, n_head=4, vocab_size=V, n_positions=32, use_cache=False,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, V, (B, T)).to(device)
    return model, ids


@pytest.fixture(scope="module")
def gpt2_measured():  # type: ignore[no-untyped-def]
    model, ids = _gpt2()
    seq = autopipe.flatten(model, (ids,))
    state = copy.deepcopy(model.state_dict())
    prof = autopipe.profile(seq, (ids,), warmup=1, repeats=2, progress=False)
    return model, ids, seq, prof, state


def test_gpt2_profile_covers_every_layer(gpt2_measured) -> None:  # type: ignore[no-untyped-def]
    """Every GPT-2 layer gets positive times, its parameters, and the sequence's signature."""
    model, ids, seq, prof, _ = gpt2_measured
    assert len(prof.layers) == len(seq.layers)
    assert all(c.forward_time > 0 and c.backward_time > 0 for c in prof.layers)
    assert sum(c.params for c in prof.layers) == sum(p.numel() for p in model.parameters()) + V * D  # tied twice
    assert prof.signature == seq.signature and prof.microbatch == {"args[0]": [B, T]}
    assert prof.input_bytes == B * T * 8


def test_gpt2_tied_embedding_counted_per_layer_and_once_in_static_bytes(gpt2_measured) -> None:  # type: ignore[no-untyped-def]
    """The tied wte/lm_head weight is in both layers using it; tied_static_bytes prices one copy."""
    _, _, seq, prof, _ = gpt2_measured
    (group,) = seq.tied
    assert prof.tied_static_bytes == {group.canonical: V * D * 4 * 4}  # param + grad + two AdamW states
    holders = [c.index for c in prof.layers if group.canonical in c.tied]
    assert holders == list(group.layers)


def test_gpt2_tied_gradient_sum_is_measured(gpt2_measured) -> None:  # type: ignore[no-untyped-def]
    """The unsplit model sums the two wte/lm_head gradients; the profile records what that costs."""
    _, _, seq, prof, _ = gpt2_measured
    (group,) = seq.tied
    assert set(prof.tied_grad_time) == {group.canonical}
    assert 0 < prof.tied_grad_time[group.canonical] < sum(prof.times)
    assert type(prof).from_dict(prof.to_dict()).tied_grad_time == prof.tied_grad_time


def test_gpt2_step_after_schedule_counts_the_tied_weight_once_per_rank(gpt2_measured, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """zbv's V puts GPT-2's embedding (chunk 0) and its tied LM head (the last chunk) on rank 0, which
    steps the shared tensor once: the plan's work after the schedule (norm, clip, AdamW) counts each
    rank's distinct parameters as the flattened layers hold them. 1F1B's two ranks each step a copy,
    and each waits for the copies' gradients to be summed: one all-reduce of the tensor's gradient
    (V x D fp32), which zbv's single holder does not pay. (Counted twice, the 6 x 256 GPT-2's zbv plan
    read 36 ms after its schedule where the job took 24; left out, the 1F1B jobs' read 7-15 ms short.)"""
    import json

    import autopipe.costs.engines as engines
    from autopipe.planner.partitioner import partition

    _, _, seq, prof, _ = gpt2_measured
    costs = engines.EngineCosts("torch", "cpu", per_op=0.002, send_latency=1e-4, bandwidth=1e9, per_step=0.005,
                                optimizer_rate=1e-8, source="test", allreduce_latency=3e-4, allreduce_bandwidth=1e9)  # fmt: skip
    reduce = costs.allreduce_time(V * D * 4)
    assert reduce == pytest.approx(3e-4 + V * D * 4 / 1e9)
    (tmp_path / "table.json").write_text(json.dumps({"devices": {"cpu": {"torch": costs.to_dict()}}}))
    monkeypatch.setattr(engines, "TABLE", tmp_path / "table.json")
    n = len(seq.layers)
    for schedule, bounds in (("zbv", (0, n - 3, n - 2, n - 1, n)), ("1f1b", (0, 2, n))):
        plan = partition(prof, 2, microbatches=4, schedule=schedule, recompute="none", engine="torch", boundaries=list(bounds))
        held = []
        for r in range(2):
            layers = [i for c, (a, b) in enumerate(zip(bounds, bounds[1:])) if plan.stage_ranks[c] == r for i in range(a, b)]
            distinct = {id(p): p.numel() for i in layers for p in seq.layers[i].parameters()}
            held.append(sum(distinct.values()))
        summed = reduce if schedule == "1f1b" else 0.0  # 1F1B: a copy on each rank, summed after the schedule
        assert plan.step_overhead == pytest.approx(max(costs.after_schedule(h) + summed for h in held), rel=1e-12)
        if schedule == "zbv":  # the rank with both users is the one the step waits for
            assert held[0] > held[1]
    assert held[0] + held[1] == sum(p.numel() for p in seq.parameters()) + V * D  # 1F1B: a copy on each rank


def test_gpt2_identical_blocks_measured_once(gpt2_measured) -> None:  # type: ignore[no-untyped-def]
    """Blocks with one structure key and input signature are measured once, then reused."""
    _, _, seq, prof, _ = gpt2_measured
    by_key: dict[str, list[int]] = {}
    for info in seq.infos:
        by_key.setdefault(info.structure, []).append(info.index)
    repeated = [idx for idx in by_key.values() if len(idx) > 1]
    assert repeated, "the tiny GPT-2 should have identical blocks"
    for idx in repeated:
        assert [prof.layers[i].source for i in idx] == ["measured"] + ["reused"] * (len(idx) - 1)
        # their own figures are one measurement; each then carries its own time inside the model
        assert len({(prof.layers[i].forward_time, prof.layers[i].backward_time) for i in idx}) == 1


def test_gpt2_activation_bytes_add_up_to_whole_model(gpt2_measured) -> None:  # type: ignore[no-untyped-def]
    """Summed per-layer activation bytes equal the whole sequence's saved-tensor bytes."""
    _, ids, seq, prof, _ = gpt2_measured
    static = set().union(*(static_storage_keys(layer) for layer in seq.layers))
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if storage_key(t) not in static:
            saved[storage_key(t)] = t.untyped_storage().nbytes()
        return t

    was = seq.training
    seq.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = seq(ids)
    seq.train(was)
    assert sum(c.activation_bytes for c in prof.layers) == sum(saved.values())
    del out


def test_gpt2_weights_unchanged(gpt2_measured) -> None:  # type: ignore[no-untyped-def]
    """Profiling GPT-2 leaves every parameter and buffer bit-identical and no gradients behind."""
    model, _, _, _, state = gpt2_measured
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert all(p.grad is None for p in model.parameters())


def test_gpt2_estimate_on_meta_matches_cpu_traced_flops() -> None:
    """Estimating a meta GPT-2 needs no weights, and counts the same FLOPs as the CPU-traced one."""
    meta_model, meta_ids = _gpt2("meta")
    meta_seq = autopipe.flatten(meta_model, (meta_ids,))
    est = autopipe.profile(meta_seq, (meta_ids,), estimate=True, device="h100", progress=False)
    assert est.mode == "estimated" and est.device.name == KNOWN_DEVICES["h100"].name
    assert all(c.source in ("estimated", "reused") and c.time > 0 for c in est.layers)
    # One block's matmuls: qkv 3*D*D, proj D*D, mlp 2*4*D*D, plus attention 2*T*T*D: 2 FLOPs each MAC.
    block_flops = 2 * B * T * (12 * D * D) + 2 * 2 * B * T * T * D
    blocks = [c for c in est.layers if c.name.startswith("transformer.h.")]
    assert [c.flops for c in blocks] == [block_flops] * LAYERS
    cpu_model, cpu_ids = _gpt2()
    cpu_seq = autopipe.flatten(cpu_model, (cpu_ids,))
    cpu_est = autopipe.profile(cpu_seq, (cpu_ids,), estimate=True, device="h100", progress=False)
    assert sum(c.flops for c in cpu_est.layers) == sum(c.flops for c in est.layers)
    # The two traces may cut the glue differently; the totals are the same model's.
    assert sum(c.activation_bytes for c in cpu_est.layers) == sum(c.activation_bytes for c in est.layers)


def test_roofline_prices_a_large_matmul_by_its_flops() -> None:
    """A big Linear on meta is compute-bound: time = FLOPs / (peak * efficiency) + launch overhead."""
    n = 4096
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(n, n, bias=False)).to(torch.bfloat16)
    x = torch.empty(n, n, device="meta", dtype=torch.bfloat16)
    seq = autopipe.flatten(model, (x,))
    prof = autopipe.profile(seq, (x,), estimate=True, device="h100", mixed_precision=True,
                            progress=False)
    spec = KNOWN_DEVICES["h100"]
    flops = 2 * n**3
    assert prof.layers[0].flops == flops
    assert prof.layers[0].forward_time == pytest.approx(flops / (989e12 * spec.compute_efficiency) + spec.op_overhead)
    # Backward needs only the weight gradient (the input needs none): one matmul as well.
    assert prof.layers[0].backward_time == pytest.approx(prof.layers[0].forward_time, rel=1e-6)
    assert prof.layers[0].param_bytes == n * n * 2 and prof.device.peak_flops == 989e12


def test_cpu_probe_and_unknown_device() -> None:
    """The CPU probe gives positive peaks; an unknown estimate target is a clear error."""
    spec = device_spec("cpu")
    assert spec.flops["float32"] > 0 and spec.memory_bandwidth > 0 and spec.op_overhead > 0
    with pytest.raises(AutopipeError, match="unknown device"):
        device_spec("tpu-v9")
