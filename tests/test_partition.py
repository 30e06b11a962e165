"""The partition pass on hand-made profiles: exact cuts, memory, overrides, errors and the Plan record."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe import Profile
from autopipe.errors import InfeasibleMemoryError, PartitionError, RecordError
from autopipe.planner.partitioner import partition
from autopipe.planner.plan import Plan
from autopipe.units import parse_size

MB = 10**6


def lm_profile() -> Profile:
    """Light embedding (1 s, 38M params), 24 equal blocks (10 s, 7M), heavy head (30 s, 38M)."""
    names = ["wte"] + [f"h.{i}" for i in range(24)] + ["lm_head"]
    times = [1.0] + [10.0] * 24 + [30.0]
    params = [38 * MB] + [7 * MB] * 24 + [38 * MB]
    return Profile.from_costs(times, param_bytes=params, names=names)


def test_lm_profile_exact_cut() -> None:
    """1F1B, 8 micro-batches: embedding + 7 blocks, 7, 7, 3 blocks + head (step 755), not the most balanced cut.

    The cut with the least bottleneck (70: embedding + 6 blocks, 7, 7, 4 + head) steps in 761: the
    last stage of 1F1B runs its 8 micro-batches after the others filled the pipe, so lightening it
    (60) beats a slightly heavier first stage (71).
    """
    plan = partition(lm_profile(), 4, bandwidth=None)
    assert plan.boundaries == (0, 8, 15, 22, 26)
    assert plan.stage_times == (71.0, 70.0, 70.0, 60.0)
    assert plan.step_time == pytest.approx(755.0)
    assert plan.step_lower_bound == plan.step_time and plan.step_gap == 0.0  # proven optimal
    assert plan.method == "autopipe"
    balanced = partition(lm_profile(), 4, bandwidth=None, boundaries=[0, 7, 14, 21, 26])
    assert balanced.bottleneck_time == 70.0 and balanced.step_time == pytest.approx(761.0)


def test_parameters_baseline_is_clearly_worse_on_lm_profile() -> None:
    """Balancing parameters gives 3, 9, 9, 3 blocks: bottleneck 90, and a step well above autopipe's 755."""
    plan = partition(lm_profile(), 4, bandwidth=None, method="parameters")
    assert plan.boundaries == (0, 4, 13, 22, 26)
    assert plan.bottleneck_time == 90.0
    assert plan.optimum_bottleneck_time == 71.0
    assert plan.optimum_step_time == pytest.approx(755.0)
    assert plan.step_time > 1.1 * plan.optimum_step_time
    assert plan.step_lower_bound == pytest.approx(755.0)  # the bound holds for every cut, this one too


def test_expensive_cut_is_avoided() -> None:
    """A cut whose tuple is large costs both neighbours 2 x bytes / bandwidth, so the solver cuts elsewhere."""
    out = [0, 0, 0, 10, 0, 0, 0, 0]
    prof = Profile.from_costs([1.0] * 8, output_bytes=out)
    plan = partition(prof, 2, bandwidth=1.0)
    assert plan.boundaries[1] in (3, 5)
    assert plan.bottleneck_time == 5.0
    cut_there = partition(prof, 2, bandwidth=1.0, boundaries=[0, 4, 8])
    assert cut_there.stage_times == (24.0, 24.0)  # 4 + 2 x 10 each side
    assert cut_there.optimum_bottleneck_time == 5.0


def test_1f1b_memory_moves_layers_off_the_first_stage() -> None:
    """1F1B keeps 2 micro-batches on stage 0 and 1 on stage 1; a limit of 300 B leaves stage 0 one layer."""
    prof = Profile.from_costs([1.0] * 4, activation_bytes=[100] * 4)
    assert partition(prof, 2, microbatches=4, bandwidth=None).boundaries == (0, 2, 4)
    plan = partition(prof, 2, microbatches=4, bandwidth=None, memory_limit=300, recompute="none")
    assert plan.boundaries == (0, 1, 4)
    assert plan.stage_memory == (200, 300)
    assert plan.stage_inflight == (2, 1)
    gpipe = partition(prof, 2, microbatches=4, bandwidth=None, memory_limit=800, schedule="gpipe")
    assert gpipe.stage_memory == (800, 800)  # all 4 micro-batches in flight on both stages


def test_ties_go_to_the_lower_peak_memory() -> None:
    """Two cuts with bottleneck 1: the one leaving the activation-heavy layer on the last stage wins."""
    prof = Profile.from_costs([1.0, 0.0, 1.0], activation_bytes=[0, 10, 0])
    plan = partition(prof, 2, microbatches=2, bandwidth=None)
    assert plan.boundaries == (0, 1, 3)
    assert plan.peak_memory == 10


def test_tied_tensor_counted_once_per_stage() -> None:
    """Two layers sharing a tied tensor in one stage hold one copy; apart, each stage holds one."""
    prof = Profile.from_costs([1.0] * 3, param_bytes=[10, 0, 10], optimizer="sgd")
    layers = list(prof.layers)
    layers[0] = replace(layers[0], tied=("wte",))
    layers[2] = replace(layers[2], tied=("wte",))
    prof = replace(prof, layers=tuple(layers), tied_static_bytes={"wte": 20})
    together = partition(prof, 1, bandwidth=None)
    assert together.stage_memory == (20,)
    apart = partition(prof, 2, bandwidth=None, boundaries=[0, 1, 3])
    assert apart.stage_memory == (20, 20)


def test_optimizer_override_changes_static_memory() -> None:
    """AdamW keeps 2 state bytes per parameter byte (on a CPU its fused step adds none; where foreach
    AdamW steps, one more while it steps: its sqrt of exp_avg_sq); SGD none."""
    prof = Profile.from_costs([1.0, 1.0], param_bytes=[100, 100])
    assert partition(prof, 2, bandwidth=None).stage_memory == (400, 400)
    foreach = replace(prof, device=replace(prof.device, type="mps"))
    assert partition(foreach, 2, bandwidth=None).stage_memory == (500, 500)
    assert partition(prof, 2, bandwidth=None, optimizer="sgd").stage_memory == (200, 200)


def test_layer_too_big_alone_is_named() -> None:
    """When one layer exceeds the limit by itself the error names it and the memory needed."""
    prof = Profile.from_costs([1.0] * 4, param_bytes=[10, 10, 500, 10], names=["a", "b", "huge", "d"], optimizer="sgd")
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, memory_limit=900, bandwidth=None)
    msg = str(info.value)
    assert "layer 2 (huge)" in msg and "1000 B" in msg and "no number of stages" in msg


def _fewest_stages_that_fit(static: list[int], limit: int) -> int:
    """Brute force: the smallest S for which some cut keeps every stage's static bytes within limit."""
    n = len(static)
    for s in range(1, n + 1):
        for inner in itertools.combinations(range(1, n), s - 1):
            b = (0, *inner, n)
            if all(sum(static[x:y]) <= limit for x, y in zip(b, b[1:])):
                return s
    raise AssertionError


def test_infeasible_says_how_many_stages_would_fit() -> None:
    """Too few stages: the error gives the smallest stage count that fits and the memory per device needed."""
    params = [30, 10, 20, 40, 10, 30, 20, 10]
    prof = Profile.from_costs([1.0] * 8, param_bytes=params, optimizer="sgd")
    static = [2 * p for p in params]
    fewest = _fewest_stages_that_fit(static, 100)
    assert fewest > 2
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, memory_limit=100, bandwidth=None)
    best_two = min(max(sum(static[:c]), sum(static[c:])) for c in range(1, 8))
    assert f"{fewest} stages would fit" in str(info.value)
    assert f"--memory-limit {best_two}B fits 2 stages" in str(info.value)


@pytest.mark.parametrize("reserve", [0, 77_000_000])
def test_the_memory_limit_a_refusal_suggests_fits_when_tried(reserve: int) -> None:
    """The limit the refusal names is never below what the runtime holds alone (the profile's
    reserve), and partitioning under it, as a person would type it, succeeds: tried here."""
    import re
    from dataclasses import replace

    params = [3_000_000, 1_000_000, 2_000_000, 4_000_000, 1_000_000, 3_000_000, 2_000_000, 1_000_000]
    prof = replace(Profile.from_costs([1.0] * 8, param_bytes=params, activation_bytes=[500_000] * 8,
                                      output_bytes=[10_000] * 8), reserve_bytes=reserve)
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, memory_limit=reserve + 25_000_000, bandwidth=None)
    suggested = re.search(r"--memory-limit (\S+) fits 2 stages", str(info.value))
    assert suggested, str(info.value)
    assert parse_size(suggested[1]) > reserve
    plan = partition(prof, 2, memory_limit=suggested[1], bandwidth=None)
    assert plan.stages == 2 and max(plan.rank_memory) <= parse_size(suggested[1])


def test_manual_boundaries_report_optimum() -> None:
    """Your own boundaries give a 'manual' plan with their cost beside the optimum."""
    plan = partition(lm_profile(), 4, bandwidth=None, boundaries=[0, 5, 12, 19, 26])
    assert plan.method == "manual"
    assert plan.stage_times == (41.0, 70.0, 70.0, 90.0)
    assert plan.optimum_bottleneck_time == 71.0 and plan.optimum_step_time == pytest.approx(755.0)
    assert plan.step_time > plan.optimum_step_time


def test_stage_names_become_boundaries() -> None:
    """Module names per stage (prefixes of layer names) are turned into the same boundaries."""
    names = [["wte"] + [f"h.{i}" for i in range(6)], [f"h.{i}" for i in range(6, 13)],
             [f"h.{i}" for i in range(13, 20)], [f"h.{i}" for i in range(20, 24)] + ["lm_head"]]  # fmt: skip
    plan = partition(lm_profile(), 4, bandwidth=None, stage_names=names)
    assert plan.boundaries == (0, 7, 14, 21, 26)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(boundaries=[0, 5, 5, 20, 26]), "empty"),
        (dict(boundaries=[0, 5, 26]), "5 layer indices"),
        (dict(boundaries=[0, 1.5, 12, 19, 26]), r"whole layer indices, but 1\.5"),
        (dict(boundaries=[0, "7", 12, 19, 26]), "whole layer indices, but '7'"),
        (dict(weight_share=1.5), r"weight_share must be between 0 and 1, got 1\.5"),
        (dict(weight_share=-0.1), r"weight_share must be between 0 and 1, got -0\.1"),
        (dict(weight_share=float("nan")), "weight_share must be between 0 and 1, got nan"),
        (dict(stage_names=[["wte"], ["h.0"], ["h.1"], ["lm_head"]]), "no chunk"),
        (dict(stage_names=[["h.0"], ["wte"], [f"h.{i}" for i in range(1, 24)], ["lm_head"]]), "contiguous"),
        (dict(stage_names=[["nope"], ["h"], ["h.1"], ["lm_head"]]), "names no layer"),
        (dict(stage_names=[["wte", "h.0"], [], [f"h.{i}" for i in range(1, 24)], ["lm_head"]]), "chunk 1 is empty"),
        (dict(stage_names=[["wte"], ["h"], ["lm_head"], []]), "chunk 3 is empty"),
    ],
)
def test_bad_overrides_are_explained(kwargs, match) -> None:
    """Bad boundaries or stage names raise PartitionError saying what is wrong."""
    with pytest.raises(PartitionError, match=match):
        partition(lm_profile(), 4, bandwidth=None, **kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(stages=0), "stages must be at least 1, got 0"),
        (dict(stages=-2), "stages must be at least 1, got -2"),
        (dict(stages=2, microbatches=0), "micro-batches must be at least 1, got 0"),
        (dict(stages=2, microbatches=-1), "micro-batches must be at least 1, got -1"),
        (dict(stages=2, schedule="interleaved1f1b", virtual_stages=0), "virtual stages must be at least 1, got 0"),
        (dict(stages=2, schedule="zbv", virtual_stages=0), "virtual stages must be at least 1, got 0"),
    ],
)
def test_zero_or_negative_counts_are_refused(kwargs, match) -> None:
    """0 or a negative count is an error naming the option, never silently the default."""
    with pytest.raises(PartitionError, match=match):
        partition(lm_profile(), **kwargs)


def test_plan_simulate_refuses_zero_microbatches() -> None:
    """plan.simulate(microbatches=0) is an error, not the plan's own micro-batches."""
    plan = partition(lm_profile(), 2, microbatches=4)
    with pytest.raises(PartitionError, match="micro-batches must be at least 1, got 0"):
        plan.simulate(microbatches=0)


def test_too_many_stages_is_an_error() -> None:
    """More chunks than layers cannot be cut without an empty stage."""
    with pytest.raises(PartitionError, match="at most 3 stages"):
        partition(Profile.from_costs([1.0] * 3), 4)


def test_virtual_stages_cut_into_s_times_v_chunks() -> None:
    """Interleaved with v = 2 cuts 2S chunks placed round-robin; zbv places them in a V."""
    plan = partition(lm_profile(), 2, schedule="interleaved1f1b", virtual_stages=2, microbatches=4, bandwidth=None)
    assert len(plan.boundaries) == 5 and plan.stage_ranks == (0, 1, 0, 1)
    assert len(plan.rank_times) == 2
    assert partition(lm_profile(), 2, schedule="Interleaved1F1B", microbatches=4).virtual_stages == 2
    zbv = partition(lm_profile(), 2, schedule="zbv", microbatches=4, bandwidth=None)
    assert zbv.virtual_stages == 2 and zbv.stage_ranks == (0, 1, 1, 0)


def test_plan_json_round_trip(tmp_path) -> None:
    """A plan saved as JSON loads back equal, with kind and schema; another record is refused."""
    plan = partition(lm_profile(), 4, method="uniform")
    path = tmp_path / "plan.json"
    plan.save(path)
    data = json.loads(path.read_text())
    assert data["kind"] == "autopipe.plan" and data["schema"] == 1
    assert Plan.load(path) == plan
    no_comm = partition(lm_profile(), 4, bandwidth=None)
    no_comm.save(path)
    assert Plan.load(path) == no_comm
    data["schema"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(RecordError, match="schema 99"):
        Plan.load(path)
    path.write_text(json.dumps({"kind": "autopipe.profile"}))
    with pytest.raises(RecordError, match="not an autopipe plan"):
        Plan.load(path)


def test_plan_simulate_draws_every_op() -> None:
    """plan.simulate returns a timeline with one F and one B per micro-batch and stage."""
    plan = partition(lm_profile(), 4, bandwidth=None, microbatches=8)
    sim = plan.simulate()
    assert sim.step_time == pytest.approx(plan.step_time)
    assert sum(len(tl) for tl in sim.timeline) == 2 * 8 * 4
    assert plan.simulate("gpipe", 8).step_time >= sim.step_time


def test_public_names_after_submodule_import() -> None:
    """autopipe.partition stays callable after its submodule is imported; autopipe.Plan is the record."""
    import autopipe.planner.partitioner  # noqa: F401  (the submodule must not shadow the function)

    assert autopipe.partition is partition
    prof = Profile.from_costs([1.0, 1.0, 2.0])
    assert autopipe.partition(prof, 2, bandwidth=None).boundaries == (0, 2, 3)
    assert autopipe.Plan is Plan


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * 2**30), ("512MB", 512 * 10**6), ("1.5k", 1536), ("100", 100), (2048, 2048)])
def test_parse_size(text, expected) -> None:
    """Sizes accept binary (GiB, k) and decimal (MB) units and plain bytes."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["80 gigs", "GiB", "-5GB", "0", ""])
def test_parse_size_rejects_bad_values(text) -> None:
    """Bad sizes raise PartitionError with an example of a good one."""
    with pytest.raises(PartitionError):
        parse_size(text)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=1, max_size=30),
    st.lists(st.integers(0, 50), min_size=30, max_size=30),
    st.lists(st.integers(0, 5), min_size=30, max_size=30),
    st.integers(1, 6),
    st.sampled_from(["gpipe", "1f1b"]),
)
def test_never_worse_than_any_baseline(times, params, out, stages, schedule) -> None:
    """autopipe's simulated step is <= every baseline's on the same costs, and no stage is ever empty."""
    n = len(times)
    stages = min(stages, n)
    prof = Profile.from_costs([float(t) for t in times], param_bytes=params[:n], output_bytes=out[:n],
                              names=[("block" if i % 2 else "other") + str(i) for i in range(n)])  # fmt: skip
    best = partition(prof, stages, bandwidth=1.0, schedule=schedule)
    assert all(x < y for x, y in zip(best.boundaries, best.boundaries[1:]))
    for method in ("uniform", "parameters", "torchtitan", "greedy", "type:block"):
        if method == "type:block" and n < 2:
            continue
        other = partition(prof, stages, bandwidth=1.0, schedule=schedule, method=method)
        assert all(x < y for x, y in zip(other.boundaries, other.boundaries[1:]))
        assert best.step_time <= other.step_time * (1 + 1e-9)  # equal steps summed in another order differ in the last bits


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.sampled_from([0.5, 1.0, 2.0, 7.0]), min_size=8, max_size=16),
    st.integers(1, 4),
    st.integers(1, 12),
)
def test_zbv_plan_charges_what_the_runtime_s_order_holds(times, stages, m) -> None:
    """A zbv plan's in-flight micro-batches per chunk are what torch's ZBVZeroBubble order holds
    (F to W), the order train.py runs, whatever the layers cost."""
    from _torch_orders import torch_zbv_order as _torch_zbv_order

    prof = Profile.from_costs(times, activation_bytes=[1] * len(times))
    plan = partition(prof, stages, schedule="zbv", microbatches=m, bandwidth=None)
    peak = [0] * plan.num_chunks
    for r in range(stages):
        held = [0] * plan.num_chunks
        for kind, _, c in _torch_zbv_order(stages, m, r):
            held[c] += {"F": 1, "W": -1}.get(kind, 0)
            peak[c] = max(peak[c], held[c])
    assert list(plan.stage_inflight) == peak


def test_parse_bandwidth() -> None:
    """Bandwidths read like sizes (per second); 'none' ignores communication; 0 is refused as a bandwidth."""
    from autopipe.units import parse_bandwidth

    assert parse_bandwidth("25GB") == 25e9 and parse_bandwidth("none") is None and parse_bandwidth(" Inf ") is None
    with pytest.raises(PartitionError, match="bandwidth '0' must be more than 0 bytes per second"):
        parse_bandwidth("0")
    with pytest.raises(PartitionError, match="bad bandwidth '-1GB'"):
        parse_bandwidth("-1GB")
