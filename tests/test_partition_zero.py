"""ZeRO in the plan: per-rank memory under each sharding, the solver raising the stage to fit, and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from autopipe import Profile, partition
from autopipe.cli import app
from autopipe.errors import AutopipeError, InfeasibleMemoryError, PartitionError
from autopipe.job.converter import convert
from autopipe.planner.memory import rank_memory
from autopipe.planner.plan import Plan


def _profile(n: int = 8) -> Profile:
    """n layers of 400 B parameters (AdamW: 400 B gradients, 800 B state), 50 B activations."""
    return Profile.from_costs([1.0 + (i % 3) for i in range(n)], param_bytes=[400] * n,
                              activation_bytes=[50] * n, output_bytes=[8] * n)  # fmt: skip


def test_the_plan_charges_each_rank_its_shards() -> None:
    """The plan's per-rank memory is autopipe.planner.memory's for its dp and ZeRO stage, and shrinks as it should."""
    prof = _profile()
    totals = {}
    for zero in (0, 1, 2, 3):
        plan = partition(prof, 2, dp=4, zero=zero, memory_limit=None, bandwidth=None)
        assert (plan.dp, plan.zero) == (4, zero)
        expect = rank_memory(prof, plan.boundaries, stage_ranks=plan.stage_ranks, inflight=plan.stage_inflight,
                             microbatches=plan.microbatches, recompute=plan.stage_recompute, dp=4, zero=zero)  # fmt: skip
        assert plan.rank_memory == tuple(m.total for m in expect)
        assert plan.rank_memory_breakdown[0]["optimizer"] == (3200 if zero == 0 else 800)
        totals[zero] = plan.peak_memory
    assert totals[1] < totals[0]  # optimizer state / 4
    assert totals[2] == totals[3]  # pipelining keeps ZeRO 3's parameters gathered for the whole step


def test_zero_0_and_1_charge_replicate_s_copies_under_zbv_only() -> None:
    """ZeRO 0/1 run on DDP under 1f1b (its buckets are the gradients: nothing more) and on replicate
    under zbv (its own weights + accumulated gradients: 400 + 400 B per layer more, on the rank's layers)."""
    prof = _profile()
    for zero in (0, 1):
        plain = partition(prof, 2, dp=4, zero=zero, memory_limit=None, bandwidth=None, schedule="1f1b")
        zbv = partition(prof, 2, dp=4, zero=zero, memory_limit=None, bandwidth=None, schedule="zbv")
        assert [m["data_parallel"] for m in plain.rank_memory_breakdown] == [0, 0]
        layers = [sum(b - a for a, b, r in zip(zbv.boundaries, zbv.boundaries[1:], zbv.stage_ranks) if r == rank)
                  for rank in (0, 1)]
        assert [m["data_parallel"] for m in zbv.rank_memory_breakdown] == [800 * n for n in layers]


def test_auto_takes_the_lowest_stage_that_fits() -> None:
    """No limit: ZeRO 0 (nothing to gain by sharding); a limit only ZeRO 1 meets: ZeRO 1; one replica: 0."""
    prof = _profile()
    free = partition(prof, 2, dp=4, zero="auto", memory_limit=None, bandwidth=None)
    assert (free.zero, free.zero_policy) == (0, "auto")
    z0 = partition(prof, 2, dp=4, zero=0, memory_limit=None, bandwidth=None, recompute="none")
    z1 = partition(prof, 2, dp=4, zero=1, memory_limit=None, bandwidth=None, recompute="none")
    limit = (z0.peak_memory + z1.peak_memory) // 2
    tight = partition(prof, 2, dp=4, zero="auto", memory_limit=limit, bandwidth=None, recompute="none")
    assert tight.zero == 1 and tight.peak_memory <= limit
    assert partition(prof, 2, zero="auto", memory_limit=None, bandwidth=None).zero == 0


def test_a_fixed_stage_that_does_not_fit_says_which_would() -> None:
    prof = _profile()
    z1 = partition(prof, 2, dp=4, zero=1, memory_limit=None, bandwidth=None, recompute="none")
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, dp=4, zero=0, memory_limit=z1.peak_memory, bandwidth=None, recompute="none")
    text = str(info.value)
    assert "ZeRO 1 over the 4 replicas fits (--zero 1)" in text and "\n" not in text


@pytest.mark.parametrize("dp, zero, message", [(0, 0, "dp=0"), (2, 4, "zero=4"), (2, "two", "zero='two'"),
                                               (2, True, "zero=True"), (2.5, 0, "dp=2.5")])
def test_bad_dp_or_zero_is_refused(dp, zero, message) -> None:
    with pytest.raises(PartitionError, match=message):
        partition(_profile(), 2, dp=dp, zero=zero)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=4, max_size=9), st.integers(2, 4),
       st.sampled_from([0, 1, 2, 3, "auto"]), st.integers(500, 6000), st.sampled_from(["1f1b", "gpipe", "zbv"]))
def test_plans_never_exceed_the_limit_under_any_sharding(params, dp, zero, limit, schedule) -> None:
    """Whatever the sharding, a plan's ranks fit the limit in the memory model's exact bytes."""
    n = len(params)
    prof = Profile.from_costs([1.0] * n, param_bytes=[100 * p for p in params], activation_bytes=[30] * n,
                              output_bytes=[5] * n)  # fmt: skip
    try:
        plan = partition(prof, 2, dp=dp, zero=zero, memory_limit=limit, bandwidth=None, schedule=schedule)
    except InfeasibleMemoryError:
        return
    assert plan.peak_memory <= limit


def test_plan_json_keeps_the_sharding_and_older_plans_load_as_one_replica(tmp_path) -> None:
    plan = partition(_profile(), 2, dp=2, zero="auto", memory_limit=None, bandwidth=None)
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert (back.dp, back.zero, back.zero_policy) == (2, 0, "auto")
    old = json.loads((tmp_path / "plan.json").read_text())
    for key in ("dp", "zero", "zero_policy"):
        del old[key]
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert (Plan.load(tmp_path / "old.json").dp, Plan.load(tmp_path / "old.json").zero) == (1, 0)
    old["zero"] = 5
    (tmp_path / "bad.json").write_text(json.dumps(old))
    with pytest.raises(AutopipeError, match="plan zero is 5"):
        Plan.load(tmp_path / "bad.json")


def test_cli_plan_with_replicas_and_zero(tmp_path) -> None:
    _profile().save(tmp_path / "p.json")
    runner = CliRunner()
    result = runner.invoke(app, ["plan", str(tmp_path / "p.json"), "--stages", "2", "--dp", "4", "--zero", "1",
                                 "--memory-limit", "none"], env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "per rank with 4 data-parallel replicas, ZeRO 1" in result.output
    result = runner.invoke(app, ["plan", str(tmp_path / "p.json"), "--stages", "2", "--dp", "2", "--zero", "auto",
                                 "--json"])  # fmt: skip
    data = json.loads(result.output)["plan"]
    assert (data["dp"], data["zero"], data["zero_policy"]) == (2, 0, "auto")
    for args, message in ((["--zero", "half"], "--zero 'half'"), (["--zero", "9"], "zero=9"), (["--dp", "0"], "dp=0")):
        result = runner.invoke(app, ["plan", str(tmp_path / "p.json"), "--stages", "2", *args])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_convert_refuses_zero_deepspeed_cannot_run(tmp_path) -> None:
    """DeepSpeed's pipeline engine has ZeRO 0 and 1 only: refused before any pass, nothing written."""
    with pytest.raises(AutopipeError, match="--zero 2 does not run on --engine deepspeed"):
        convert("gpt2", stages=2, engine="deepspeed", dp=2, zero=2, out=tmp_path / "job")
    assert not (tmp_path / "job").exists()
