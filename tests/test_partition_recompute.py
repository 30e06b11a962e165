"""Recompute chosen by the partitioner: exact answers on layers of known cost, forced modes, records."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from autopipe import Profile
from autopipe.costs.layer_costs import RecomputeCost
from autopipe.errors import InfeasibleMemoryError, PartitionError
from autopipe.planner.chunk_costs import ChunkCosts
from autopipe.planner.partitioner import partition
from autopipe.planner.plan import Plan


def four_layers() -> Profile:
    """4 layers of 1 s (1/3 forward), 100 B of activations each, 10 B crossing every cut and entering layer 0."""
    prof = Profile.from_costs([1.0] * 4, activation_bytes=[100] * 4, output_bytes=[10] * 4)
    return replace(prof, input_bytes=10)


def test_only_recompute_of_the_first_stage_fits_and_is_chosen() -> None:
    """1F1B holds 2 micro-batches on stage 0: at 350 B the 2+2 cut fits only with stage 0 recomputing.

    Each stage also holds one 10 B receive buffer per micro-batch (4) at the cut, and the last stage
    the model's 10 B output per micro-batch in flight. Full recompute keeps each layer's 10 B input
    (2 x 2 x 10) plus the 90 B more one layer rebuilds in backward: 170 B with the buffers, and adds
    the forward (1/3 s per layer). Steps: 1+3 without recompute 13, 2+2 with it 12.
    """
    none = partition(four_layers(), 2, microbatches=4, bandwidth=None, memory_limit=350, recompute="none")
    assert none.boundaries == (0, 1, 4) and none.stage_recompute == ("none", "none")
    assert none.stage_memory == (2 * 100 + 40, 300 + 40 + 10) and none.step_time == pytest.approx(13.0)
    auto = partition(four_layers(), 2, microbatches=4, bandwidth=None, memory_limit=350, recompute="auto")
    assert auto.boundaries == (0, 2, 4) and auto.stage_recompute == ("full", "none")
    assert auto.stage_memory == (2 * 2 * 10 + 90 + 40, 200 + 40 + 10)
    assert auto.stage_times == pytest.approx((2 + 2 / 3, 2.0))
    assert auto.stage_backward[0] == pytest.approx(4 / 3 + 2 / 3)  # the backward plus the forward again
    assert auto.step_time == pytest.approx(12.0) and auto.step_gap == 0.0
    free = partition(four_layers(), 2, microbatches=4, bandwidth=None, recompute="auto")
    assert free.stage_recompute == ("none", "none")  # without a limit recompute only costs time


def test_forced_full_recompute_everywhere() -> None:
    """recompute='full' puts every chunk under full recompute, even where everything would fit."""
    plan = partition(four_layers(), 2, microbatches=4, bandwidth=None, recompute="full")
    assert plan.stage_recompute == ("full", "full") and plan.recompute == "full"
    assert plan.stage_times == pytest.approx((8 / 3, 8 / 3))
    # kept inputs x in flight + one layer rebuilt (90 B) + 4 receive buffers (+ the held output, last)
    assert plan.stage_memory == (2 * 20 + 90 + 40, 1 * 20 + 90 + 40 + 10)
    over = partition(four_layers(), 2, microbatches=4, bandwidth=None, recompute="full", memory_limit=100, method="uniform")
    assert over.stage_recompute == ("full", "full") and over.stage_memory == (170, 160)  # shown over the limit, still full


def test_measured_figures_replace_the_derived_ones() -> None:
    """A layer's own "full" figures win over the derived ones (input bytes, forward time)."""
    prof = four_layers()
    layers = list(prof.layers)
    layers[0] = replace(layers[0], recompute={"full": RecomputeCost(activation_bytes=1, extra_backward_time=0.5)})
    plan = partition(prof.with_layers(layers), 4, microbatches=4, bandwidth=None, recompute="full")
    assert plan.stage_memory[0] == 4 * 1 + (100 - 1) + 4 * 10  # 4 in flight on stage 0 of 4, rebuilt, buffers
    assert plan.stage_backward[0] == pytest.approx(2 / 3 + 0.5)


def test_selective_falls_back_to_none_per_layer() -> None:
    """Under selective, a layer without selective figures keeps all its activations and adds no time."""
    prof = four_layers()
    layers = list(prof.layers)
    layers[1] = replace(layers[1], recompute={"selective": RecomputeCost(activation_bytes=30, extra_backward_time=0.1)})
    plan = partition(prof.with_layers(layers), 1, microbatches=2, bandwidth=None, recompute="selective")
    assert plan.stage_recompute == ("selective",)
    assert plan.stage_inflight == (1,)  # 1F1B on one rank holds one micro-batch
    # kept + what layer 1 rebuilds beyond its kept 30 B + the model's output held for its backward
    assert plan.stage_memory == ((100 + 30 + 100 + 100) + 70 + 10,)
    assert plan.stage_backward == pytest.approx((4 * 2 / 3 + 0.1,))


def test_selective_without_figures_is_refused() -> None:
    """recompute='selective' on a profile that never measured it says what to do instead."""
    with pytest.raises(PartitionError, match="no per-layer figures for it.*recompute='auto' or 'full'"):
        partition(four_layers(), 2, recompute="selective")
    with pytest.raises(PartitionError, match="recompute='sometimes'; use one of none, auto, selective, full"):
        partition(four_layers(), 2, recompute="sometimes")


def test_infeasible_messages_say_recompute_would_fit() -> None:
    """No cut fits without recompute: the error says recompute='auto' would, in one line; so does a manual cut."""
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(four_layers(), 2, microbatches=4, bandwidth=None, memory_limit=250, recompute="none")
    assert "recompute auto (--recompute auto) would fit" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(InfeasibleMemoryError, match=r"chunk 0 \(layers 0..1\) needs 440 B.*--recompute auto"):
        partition(four_layers(), 2, microbatches=4, bandwidth=None, memory_limit=300, boundaries=[0, 2, 4],
                  recompute="none")
    auto = partition(four_layers(), 2, microbatches=4, bandwidth=None, memory_limit=300, boundaries=[0, 2, 4],
                     recompute="auto")  # fmt: skip
    assert auto.method == "manual" and auto.stage_recompute == ("full", "none")


def test_plan_json_keeps_recompute_and_bound(tmp_path) -> None:
    """The new fields survive save/load; a plan.json written before them loads with none everywhere."""
    plan = partition(four_layers(), 2, microbatches=4, bandwidth=None, memory_limit=300, recompute="auto")
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    old = json.loads(path.read_text())
    for key in ("stage_recompute", "recompute", "step_lower_bound"):
        del old[key]
    path.write_text(json.dumps(old))
    loaded = Plan.load(path)
    assert loaded.stage_recompute == () and loaded.recompute_of(0) == "none"
    assert loaded.step_lower_bound is None and loaded.step_gap is None


def test_chunk_memory_holds_the_largest_recomputed_layer() -> None:
    """memory(a, b) under a mode = static + in-flight x kept + max plain activations of [a, b), by brute force."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(1, 9))
        static, act, kept = rng.integers(0, 50, n), rng.integers(0, 50, n), rng.integers(0, 20, n)
        users = sorted(set(rng.integers(0, n, 2).tolist()))
        w = int(min(static[u] for u in users))
        costs = ChunkCosts(np.ones(n), np.ones(n), None, static, act, [(w, users)], {"full": (np.ones(n), kept)})
        for a in range(n):
            for b in range(a + 1, n + 1):
                for infl in (1, 3):
                    repeats = max(sum(a <= u < b for u in users) - 1, 0)
                    base = int(static[a:b].sum()) - w * repeats
                    assert costs.memory(a, b, infl, 0) == base + infl * int(act[a:b].sum())
                    assert costs.memory(a, b, infl, 1) == base + infl * int(kept[a:b].sum()) + int(act[a:b].max())
        for mode in (0, 1):
            for limit in (0, 40, 120, 400):
                first = costs.window_start(mode, 2, limit, "first")  # starts at 0, or nothing fits
                later = costs.window_start(mode, 2, limit, "middle")  # starts at 1 or later
                for b in range(n + 1):
                    assert first[b] == (0 if b > 0 and costs.memory(0, b, 2, mode) <= limit else b)
                    fitting = [a for a in range(1, b) if costs.memory(a, b, 2, mode) <= limit]
                    assert later[b] == (fitting[0] if fitting else b)


def _on_gpu(prof: Profile, memory: int) -> Profile:
    from autopipe.costs.layer_costs import DeviceInfo

    return replace(prof, device=DeviceInfo(name="Test GPU", type="cuda", memory_bytes=memory))


def test_the_default_limit_is_the_profiled_gpu_s_memory() -> None:
    """A profile measured on (or estimated for) a GPU is held to that GPU's memory unless told otherwise;
    a CPU profile has no default limit; recompute defaults to auto, so the tight GPU plan recomputes."""
    gpu = _on_gpu(four_layers(), 350)
    plan = partition(gpu, 2, microbatches=4, bandwidth=None)
    assert plan.memory_limit == 350 and plan.memory_limit_source == "device"
    assert plan.recompute == "auto" and plan.stage_recompute == ("full", "none") and plan.peak_memory <= 350
    assert plan.stage_recompute_time == pytest.approx((2 / 3, 0.0))  # the forward of its 2 layers again
    given = partition(gpu, 2, microbatches=4, bandwidth=None, memory_limit=1000)
    assert given.memory_limit == 1000 and given.memory_limit_source == "given" and given.stage_recompute == ("none", "none")
    for unlimited in (None, "none"):
        free = partition(gpu, 2, microbatches=4, bandwidth=None, memory_limit=unlimited)
        assert free.memory_limit is None and free.memory_limit_source == ""
    cpu = partition(four_layers(), 2, microbatches=4, bandwidth=None)
    assert cpu.memory_limit is None and cpu.stage_recompute == ("none", "none")
    with pytest.raises(InfeasibleMemoryError, match=r"fits the Test GPU's 100 B \(its memory, the default limit\)"):
        partition(_on_gpu(four_layers(), 100), 2, microbatches=4, bandwidth=None)


def test_infeasible_names_zero_when_the_optimizer_state_is_much_of_a_rank() -> None:
    """Most of each rank is AdamW state: the one-line error says how much, and that ZeRO-1 shards it."""
    prof = Profile.from_costs([1.0] * 4, param_bytes=[100] * 4)
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, memory_limit=500, bandwidth=None)
    text = str(info.value)
    assert "optimizer state is ~400 B per rank (ZeRO-1" in text and "\n" not in text
    assert "use --recompute auto" not in text  # auto is already what was asked
