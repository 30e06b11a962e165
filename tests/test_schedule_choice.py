"""``--schedule auto`` (planner.schedule_choice): every schedule the engine runs planned under the
same options, those that cannot be made skipped with why, the simplest schedule within the margin
(3%) of the least predicted whole step kept; the default of ``convert`` and ``plan --stages N``,
recorded in the plan."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from autopipe import Profile
from autopipe.cli import app
from autopipe.errors import AutopipeError, InfeasibleMemoryError, PartitionError
from autopipe.job.script import read_settings
from autopipe.job.settings import ConvertSettings
from autopipe.planner.engine_choice import plan_engines
from autopipe.planner.partitioner import partition
from autopipe.planner.plan import Plan
from autopipe.planner.schedule_choice import SCHEDULE_MARGIN, SCHEDULE_PREFERENCE, plan_schedules
from autopipe.planner.step_solver import TIE

runner = CliRunner()


def _explicit(prof: Profile, stages: int, **options) -> dict[str, Plan]:
    """What a loop over explicit schedules gives: each schedule's plan, those that can be made."""
    out = {}
    for s in SCHEDULE_PREFERENCE:
        try:
            out[s] = partition(prof, stages, schedule=s, **options)
        except PartitionError:
            pass
    return out


def _simplest_within(steps: dict[str, float], chosen: str, margin: float) -> bool:
    """``chosen`` is within ``margin`` of the least step, and every simpler schedule planned is not."""
    best = min(steps.values())
    within = {s for s, t in steps.items() if t <= best * (1 + margin) * (1 + TIE)}
    simpler = SCHEDULE_PREFERENCE[: SCHEDULE_PREFERENCE.index(chosen)]
    return chosen in within and not within & set(simpler)


def _agrees_with_the_loop(prof: Profile, stages: int, margin: float = SCHEDULE_MARGIN, **options) -> str:
    """plan_schedules keeps, of the explicit loop's plans, the simplest within the margin of the least
    whole step; each candidate is that loop's plan. With margin 0 that is the least step."""
    choice = plan_schedules(prof, stages, margin=margin, **options)
    loop = _explicit(prof, stages, **options)
    assert [s for s, _ in choice.plans] == list(loop)
    for s, p in choice.plans:
        assert p.boundaries == loop[s].boundaries and p.total_step_time == loop[s].total_step_time
    steps = {s: p.total_step_time for s, p in loop.items()}
    assert _simplest_within(steps, choice.schedule, margin)
    if margin == 0:
        assert choice.plan.total_step_time == min(steps.values())
    assert choice.plan.schedule == choice.schedule and choice.plan.schedule_policy == "auto"
    assert choice.plan.schedule_steps == steps and choice.plan.schedule_margin == margin
    return choice.schedule


def test_a_large_bubble_picks_zero_bubble() -> None:
    """Eight equal layers on 2 stages, 4 micro-batches: the 1F1B bubble is 1/5 of the step; zbv's V
    fills most of it (its deferred weight passes), interleaving some."""
    prof = Profile.from_costs([1.0] * 8)
    assert _agrees_with_the_loop(prof, 2, bandwidth=None) == "zbv"
    steps = plan_schedules(prof, 2, bandwidth=None).steps
    assert steps == pytest.approx({"1f1b": 20.0, "gpipe": 20.0, "interleaved1f1b": 18.0, "zbv": 50 / 3})


def test_no_weight_pass_to_defer_picks_interleaved() -> None:
    """With no weight gradient to defer (weight_share 0) zbv's split backward gains nothing and
    interleaved 1F1B's shorter warm-up wins."""
    prof = Profile.from_costs([1.0] * 8)
    assert _agrees_with_the_loop(prof, 2, bandwidth=None, weight_share=0.0) == "interleaved1f1b"
    steps = plan_schedules(prof, 2, bandwidth=None, weight_share=0.0).steps
    assert steps["interleaved1f1b"] == pytest.approx(18.0) and steps["zbv"] == pytest.approx(56 / 3)


def test_costly_sends_pick_one_chunk_per_rank() -> None:
    """Every cut sending 1 s each way: two chunks per rank pay twice the sends, so 1F1B wins (and
    GPipe ties with it: the simpler 1F1B is kept)."""
    prof = Profile.from_costs([1.0] * 8, output_bytes=[10**9] * 8)
    assert _agrees_with_the_loop(prof, 2, bandwidth=1e9) == "1f1b"
    steps = plan_schedules(prof, 2, bandwidth=1e9).steps
    assert steps["1f1b"] == pytest.approx(30.0) and steps["zbv"] == pytest.approx(43.0)


def test_tight_memory_keeps_the_schedule_that_fits() -> None:
    """6 MB per device holds 1F1B's 2 micro-batches of 4 MB-layer chunks but not GPipe's 4 or the
    interleaved schedules' extra chunks: 1F1B, the others skipped naming the limit."""
    prof = Profile.from_costs([1.0] * 8, activation_bytes=[10**6] * 8)
    options = dict(memory_limit="6MB", recompute="none", bandwidth=None)
    assert _agrees_with_the_loop(prof, 2, **options) == "1f1b"
    choice = plan_schedules(prof, 2, **options)
    assert [s for s, _ in choice.plans] == ["1f1b"] and choice.plan.peak_memory <= 6 * 10**6
    assert dict(choice.skipped) == {
        "gpipe": "no cut into 2 stages (gpipe, 4 micro-batches) fits 5.72 MiB per device",
        "interleaved1f1b": "no cut into 2 stages (interleaved1f1b, 4 micro-batches, 2 virtual) fits 5.72 MiB per device",
        "zbv": "no cut into 2 stages (zbv, 4 micro-batches, 2 virtual) fits 5.72 MiB per device",
    }
    assert choice.plan.schedule_skipped == dict(choice.skipped)
    # and without a limit the bubble decides again
    assert plan_schedules(prof, 2, recompute="none", bandwidth=None).schedule == "zbv"


def test_too_few_layers_for_two_chunks_per_rank() -> None:
    """3 layers on 2 stages: no 4 chunks to interleave or fold into a V; one chunk per rank remains."""
    prof = Profile.from_costs([1.0, 1.0, 1.0])
    assert _agrees_with_the_loop(prof, 2, bandwidth=None) == "1f1b"
    choice = plan_schedules(prof, 2, bandwidth=None)
    why = "cannot cut 3 layers into 4 non-empty chunks (2 stages x 2 virtual); use at most 1 stages"
    assert dict(choice.skipped) == {"interleaved1f1b": why, "zbv": why}
    assert choice.why.endswith(f"; interleaved1f1b, zbv not considered: {why}")


def test_micro_batches_the_interleaved_rule_refuses() -> None:
    """3 micro-batches on 2 stages: interleaved 1F1B needs a multiple of the stages; zbv does not."""
    prof = Profile.from_costs([1.0] * 8)
    assert _agrees_with_the_loop(prof, 2, microbatches=3, bandwidth=None) == "zbv"
    skipped = dict(plan_schedules(prof, 2, microbatches=3, bandwidth=None).skipped)
    assert skipped == {"interleaved1f1b": "interleaved1f1b needs micro-batches to be a multiple of the stages "
                                          "(3 % 2 != 0); use 4 micro-batches"}


def test_ties_go_to_the_simpler_schedule() -> None:
    """1F1B and GPipe predict the same step (to the last bits) on equal chunks: 1F1B is kept, whatever
    order the schedules are asked in; one stage plans 1F1B alone."""
    prof = Profile.from_costs([1.0] * 8)
    choice = plan_schedules(prof, 2, bandwidth=None, schedules=("gpipe", "1f1b"))
    steps = choice.steps  # 20 s each, summed in another order (GPipe's a few ulps under 1F1B's today)
    assert abs(steps["gpipe"] - steps["1f1b"]) <= TIE * steps["1f1b"] and choice.schedule == "1f1b"
    assert plan_schedules(Profile.from_costs([1.0, 1.0]), 2, bandwidth=None).schedule == "1f1b"
    eight = plan_schedules(Profile.from_costs([1.0] * 8, output_bytes=[10**9] * 8), 2, bandwidth=1e9,
                           schedules=("gpipe", "1f1b"))  # fmt: skip
    assert eight.schedule == "1f1b" and dict(eight.skipped) == {"interleaved1f1b": "not asked for", "zbv": "not asked for"}
    one = plan_schedules(Profile.from_costs([1.0] * 8), 1, bandwidth=None)
    assert one.schedule == "1f1b" and [s for s, _ in one.plans] == ["1f1b"]
    assert "gpipe, interleaved1f1b, zbv not considered: one stage runs the same chain under every schedule" in one.why


def test_a_schedule_planned_faster_inside_the_margin_is_not_chosen() -> None:
    """0.13 s sends at every cut: zbv is planned 1.6% faster than 1F1B (20.96 s against 21.3), inside
    the 3% margin, so the simpler 1F1B is kept and the line says why; margin 0 keeps zbv. With 0.1 s
    sends zbv is 5% ahead of 1F1B and interleaved 3.2%: zbv, beyond the margin."""
    prof = Profile.from_costs([1.0] * 8, output_bytes=[13 * 10**7] * 8)
    assert _agrees_with_the_loop(prof, 2, bandwidth=1e9) == "1f1b"
    assert _agrees_with_the_loop(prof, 2, margin=0.0, bandwidth=1e9) == "zbv"
    choice = plan_schedules(prof, 2, bandwidth=1e9)
    assert choice.steps["zbv"] == pytest.approx(20.9567, abs=1e-3) and choice.steps["1f1b"] == pytest.approx(21.3)
    assert choice.why.endswith("; the simpler 1f1b kept: planned 1.6% over zbv, within the 3% margin (the predictions' noise)")
    assert "kept" not in plan_schedules(prof, 2, bandwidth=1e9, margin=0.0).why
    assert choice.to_dict()["margin"] == SCHEDULE_MARGIN == 0.03
    wider = Profile.from_costs([1.0] * 8, output_bytes=[10**8] * 8)
    assert _agrees_with_the_loop(wider, 2, bandwidth=1e9) == "zbv"
    steps = plan_schedules(wider, 2, bandwidth=1e9).steps
    assert steps["interleaved1f1b"] / steps["zbv"] == pytest.approx(1.0317, abs=1e-3)
    assert _agrees_with_the_loop(wider, 2, margin=0.04, bandwidth=1e9) == "interleaved1f1b"
    with pytest.raises(PartitionError, match=r"schedule margin 3 is not a fraction in \[0, 1\); e.g. 0.03 for 3%"):
        plan_schedules(prof, 2, margin=3)


def test_auto_refuses_only_what_one_f_one_b_refuses() -> None:
    """When no schedule can be made, the refusal is 1F1B's own, word for word."""
    with pytest.raises(PartitionError) as explicit:
        partition(Profile.from_costs([1.0, 1.0]), 3, schedule="1f1b")
    with pytest.raises(PartitionError) as auto:
        plan_schedules(Profile.from_costs([1.0, 1.0]), 3)
    assert str(auto.value) == str(explicit.value) and "cannot cut 2 layers into 3" in str(auto.value)
    prof = Profile.from_costs([1.0] * 8, activation_bytes=[10**6] * 8)
    with pytest.raises(InfeasibleMemoryError) as explicit:
        partition(prof, 2, schedule="1f1b", memory_limit="3MB", recompute="none")
    with pytest.raises(InfeasibleMemoryError) as auto:
        plan_schedules(prof, 2, memory_limit="3MB", recompute="none")
    assert str(auto.value) == str(explicit.value)
    with pytest.raises(PartitionError, match="plan_schedules"):
        partition(prof, 2, schedule="auto")  # one schedule's plan; the choice is made one level up


def _stack() -> Profile:
    """A decoder of 6 blocks between an embedding and a head: what Megatron-Core can cut."""
    names = ["embed"] + [f"layers.{i}" for i in range(6)] + ["head"]
    return Profile.from_costs([0.5] + [1.0] * 6 + [0.5], names=names)


def test_an_engine_or_target_restricts_the_schedules() -> None:
    """DeepSpeed's engine (and --for deepspeed) run 1F1B only; Megatron-Core has no GPipe or zbv."""
    prof = _stack()
    ds = plan_schedules(prof, 2, engine="deepspeed", bandwidth=None)
    assert ds.schedule == "1f1b" and [s for s, _ in ds.plans] == ["1f1b"]
    assert set(dict(ds.skipped).values()) == {"DeepSpeed's pipeline engine runs its own 1F1B"}
    target = plan_schedules(prof, 2, target="deepspeed", bandwidth=None)
    assert target.schedule == "1f1b" and dict(target.skipped)["zbv"] == "DeepSpeed has no zbv schedule"
    megatron = plan_schedules(prof, 2, target="megatron", bandwidth=None)
    assert [s for s, _ in megatron.plans] == ["1f1b", "interleaved1f1b"]
    assert dict(megatron.skipped) == {"gpipe": "Megatron-Core has no gpipe schedule", "zbv": "Megatron-Core has no zbv schedule"}
    loop = {s: partition(prof, 2, schedule=s, target="megatron", bandwidth=None) for s in ("1f1b", "interleaved1f1b")}
    assert megatron.schedule == min(loop, key=lambda s: loop[s].total_step_time) == "interleaved1f1b"
    assert megatron.plan.target == "megatron"


def test_engine_auto_plans_every_engine_and_schedule_pair() -> None:
    """--engine auto with --schedule auto: each engine's plan is its best schedule's; the chosen
    engine's schedule choice is kept; DeepSpeed plans its own 1F1B."""
    prof = Profile.from_costs([1.0] * 8)
    choice = plan_engines(prof, 2, schedule="auto", bandwidth=None, importable=lambda name: True)
    plans = dict(choice.plans)
    assert plans["torch"].schedule == "zbv" and plans["deepspeed"].schedule == "1f1b"
    assert choice.engine == "torch" and choice.schedule_choice is not None and choice.schedule_choice.schedule == "zbv"
    assert "torch 16.667 s (zbv), deepspeed 20.000 s (1f1b)" in choice.why
    fixed = plan_engines(prof, 2, schedule="zbv", bandwidth=None, importable=lambda name: True)
    assert fixed.schedule_choice is None and "deepspeed" in dict(fixed.skipped)  # as before: zbv is torch's


def test_a_noisy_split_backward_makes_no_schedule_look_faster_or_slower() -> None:
    """zbv's two backward passes cost the layer's in-model backward times their timed ratio to the
    whole, at least 1: a layer whose B + W was timed at 0.08 s against a whole 0.2 s on a busy machine,
    in the model 0.01 s, costs 0.01 s under zbv, not -0.11 s (a plan auto would have chosen, and
    Plan.load refused); one timed at twice the whole costs 0.012 s: its own ratio counts up to the
    timed layers' together (1.2; an LM head's split timed alone over-read its split inside zbv jobs),
    not the 0.02 s of its own nor the 0.21 s a difference of alone timings gives."""
    from dataclasses import replace

    prof = Profile.from_costs([0.3] * 4)
    layers = list(prof.layers)
    layers[1] = replace(layers[1], backward_input_time=0.04, backward_weight_time=0.04, backward_gap=-0.19)
    layers[2] = replace(layers[2], backward_input_time=0.2, backward_weight_time=0.2, backward_gap=-0.19)
    prof = replace(prof, layers=layers)
    plan = partition(prof, 2, schedule="zbv", bandwidth=None, boundaries=(0, 1, 2, 3, 4))
    # layer 3, untimed, takes the timed layers' ratio: (0.08 + 0.4) / 0.4; layer 0 is the first
    # stage, which torch runs whole (no split)
    assert plan.stage_backward == pytest.approx((0.2, 0.01, 0.01 * 1.2, 0.2 * 1.2))
    assert Plan.from_dict(plan.to_dict()) == plan
    choice = plan_schedules(prof, 2, bandwidth=None)
    assert all(t >= 0 for _, p in choice.plans for t in p.stage_times)


def test_the_plan_records_the_choice_and_loads_back(tmp_path) -> None:
    """plan.json keeps how the schedule was chosen; a plan with a schedule given records nothing."""
    plan = plan_schedules(Profile.from_costs([1.0] * 3), 2, bandwidth=None).plan
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back == plan and back.schedule_policy == "auto" and set(back.schedule_steps) == {"1f1b", "gpipe"}
    assert back.schedule_margin == SCHEDULE_MARGIN
    assert set(back.schedule_skipped) == {"interleaved1f1b", "zbv"}
    assert partition(Profile.from_costs([1.0] * 3), 2).schedule_policy == ""


def test_convert_settings_default_to_auto_and_refuse_only_named_schedules() -> None:
    """ConvertSettings' schedule is auto by default: one chunk per stage for the early layer check,
    no DeepSpeed refusal (auto there is its 1F1B); a named schedule DeepSpeed lacks is still refused."""
    s = ConvertSettings(stages=4)
    assert s.schedule == "auto" and s.chunks_per_stage == 1
    assert ConvertSettings(stages=4, schedule="ZBV").chunks_per_stage == 2
    assert ConvertSettings(stages=2, engine="deepspeed").schedule == "auto"
    with pytest.raises(AutopipeError, match="--schedule zbv does not run on --engine deepspeed"):
        ConvertSettings(stages=2, engine="deepspeed", schedule="zbv")
    with pytest.raises(AutopipeError, match="unknown schedule 'fastest'"):
        ConvertSettings(stages=2, schedule="fastest")


# ---- the CLI -------------------------------------------------------------------------------------

def _run(*args: str):
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return result, " ".join(result.output.split())


def test_plan_cli_prints_the_choice(tmp_path) -> None:
    """`plan --stages N` plans every schedule and prints the choice in one line; --json carries it;
    an explicit --schedule 1f1b plans 1F1B alone, as before."""
    path = tmp_path / "profile.json"
    Profile.from_costs([1.0] * 8).save(path)
    result, out = _run("plan", str(path), "-s", "2", "--bandwidth", "none")
    assert result.exit_code == 0, out
    assert "schedule zbv: predicted whole step 1f1b 20 s, gpipe 20 s, interleaved1f1b 18 s, zbv 16.7 s" in out
    result, out = _run("plan", str(path), "-s", "2", "--bandwidth", "none", "--json", "--out", str(tmp_path / "p.json"))
    assert result.exit_code == 0, out
    data = json.loads(result.output)
    assert data["plan"]["schedule"] == data["schedules"]["chosen"] == "zbv"
    assert set(data["schedules"]["plans"]) == {"1f1b", "gpipe", "interleaved1f1b", "zbv"}
    assert Plan.load(tmp_path / "p.json").schedule_policy == "auto"
    result, out = _run("plan", str(path), "-s", "2", "--bandwidth", "none", "--schedule", "1f1b", "--json")
    assert result.exit_code == 0, out
    data = json.loads(result.output)
    assert data["plan"]["schedule"] == "1f1b" and data["plan"]["schedule_policy"] == "" and "schedules" not in data
    # a cut given by hand keeps the schedules with its number of chunks
    result, out = _run("plan", str(path), "-s", "2", "--bandwidth", "none", "--boundaries", "0,4,8")
    assert result.exit_code == 0, out
    assert "schedule 1f1b: predicted whole step 1f1b 20 s, gpipe 20 s; interleaved1f1b, zbv not considered: boundaries" in out


def test_plan_cli_honours_engine_and_target(tmp_path) -> None:
    """`plan --engine deepspeed` plans DeepSpeed's 1F1B alone; `--for megatron` its two schedules."""
    path = tmp_path / "profile.json"
    _stack().save(path)
    result, out = _run("plan", str(path), "-s", "2", "--bandwidth", "none", "--engine", "deepspeed", "--json")
    assert result.exit_code == 0, out
    assert json.loads(result.output)["plan"]["schedule"] == "1f1b"
    result, out = _run("plan", str(path), "-s", "2", "--bandwidth", "none", "--for", "megatron")
    assert result.exit_code == 0, out
    assert re.search(r"schedule interleaved1f1b: predicted whole step 1f1b \S+ s, interleaved1f1b \S+ s; "
                     r"gpipe not considered: Megatron-Core has no gpipe schedule", out), out


@pytest.fixture
def factory(tmp_path, monkeypatch):
    from _factories import net_factory_source

    (tmp_path / "tiny.py").write_text(net_factory_source(batch_size=4))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_convert_writes_the_chosen_schedule_everywhere(factory) -> None:
    """`convert` without --schedule writes a job whose plan.json, train.py's SCHEDULE, README and report agree
    on the schedule auto chose (the least predicted step), and says so in one line; --schedule 1f1b
    still gives 1F1B."""
    args = ["convert", "tiny.py:build", "--stages", "2", "--estimate", "--microbatches", "4"]
    result, out = _run(*args, "--out", "auto")
    assert result.exit_code == 0, out
    plan = json.loads((factory / "auto" / "plan.json").read_text())
    steps = plan["schedule_steps"]
    assert plan["schedule_policy"] == "auto" and _simplest_within(steps, plan["schedule"], plan["schedule_margin"])
    assert plan["schedule_margin"] == SCHEDULE_MARGIN
    assert read_settings(factory / "auto" / "train.py")["schedule"] == plan["schedule"]
    assert "--schedule auto" in (factory / "auto" / "README.md").read_text()
    assert "The schedule is the simplest (fewest chunks, micro-batches held and sends) within 3% of the fastest" in (
        factory / "auto" / "README.md").read_text()
    assert "schedules planned (auto)" in (factory / "auto" / "report.html").read_text()
    assert f"schedule {plan['schedule']}: predicted whole step 1f1b" in out
    result, out = _run(*args, "--out", "explicit", "--schedule", "1f1b")
    assert result.exit_code == 0, out
    plan = json.loads((factory / "explicit" / "plan.json").read_text())
    assert plan["schedule"] == "1f1b" and plan["schedule_policy"] == "" and plan["virtual_stages"] == 1
    assert read_settings(factory / "explicit" / "train.py")["schedule"] == "1f1b"
    assert "predicted whole step" not in out


def test_convert_auto_refuses_nothing_one_chunk_per_stage_runs(factory) -> None:
    """The MLP's 6 layers on 4 stages: zbv is refused before profiling (8 chunks), auto plans what fits."""
    args = ["convert", "tiny.py:build", "--stages", "4", "--estimate", "--microbatches", "4"]
    result, out = _run(*args, "--out", "zbv", "--schedule", "zbv")
    assert result.exit_code == 1 and "too few for 4 stages (2 chunks per stage under zbv)" in out, out
    result, out = _run(*args, "--out", "auto")
    assert result.exit_code == 0, out
    assert json.loads((factory / "auto" / "plan.json").read_text())["virtual_stages"] == 1
    assert "interleaved1f1b, zbv not considered: cannot cut 6 layers into 8 non-empty chunks" in out


def test_convert_deepspeed_auto_runs_its_own_one_f_one_b(factory) -> None:
    """`convert --engine deepspeed` without --schedule plans DeepSpeed's 1F1B, and says why the rest is left."""
    result, out = _run("convert", "tiny.py:build", "--stages", "2", "--estimate", "--microbatches", "4",
                       "--engine", "deepspeed", "--out", "ds")  # fmt: skip
    assert result.exit_code == 0, out
    assert json.loads((factory / "ds" / "plan.json").read_text())["schedule"] == "1f1b"
    assert "gpipe, interleaved1f1b, zbv not considered: DeepSpeed's pipeline engine runs its own 1F1B" in out
