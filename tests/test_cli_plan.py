"""`autopipe plan` through typer's CliRunner: tables, JSON, --compare, --out, and one-line errors."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from autopipe import Profile
from autopipe.cli import app
from autopipe.planner.plan import Plan

runner = CliRunner()


@pytest.fixture
def profile_path(tmp_path):
    names = ["wte"] + [f"h.{i}" for i in range(24)] + ["lm_head"]
    times = [0.001] + [0.010] * 24 + [0.030]
    params = [38_000_000] + [7_000_000] * 24 + [38_000_000]
    path = tmp_path / "profile.json"
    Profile.from_costs(times, param_bytes=params, activation_bytes=[1000] * 26, names=names).save(path)
    return path


def _run(*args: str):
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    return result, result.output


def test_plan_prints_stage_table(profile_path) -> None:
    """A plan prints one row per stage and the bottleneck summary; exit code 0."""
    result, out = _run("plan", str(profile_path), "--stages", "4", "--bandwidth", "none", "--schedule", "1f1b")
    assert result.exit_code == 0, out
    assert "0..7 (8)" in out and "22..25 (4)" in out  # the cut with the shortest 1F1B step (see test_partition)
    assert "bottleneck chunk" in out and "71.000 ms" in out
    assert "step lower bound 755.000 ms, optimal" in " ".join(out.split())


def test_plan_json_and_out(profile_path, tmp_path) -> None:
    """--json prints the plan as JSON and --out saves the same plan; a second run refuses to overwrite."""
    dest = tmp_path / "plan.json"
    result, out = _run("plan", str(profile_path), "-s", "4", "--schedule", "1f1b", "--json", "--out", str(dest))
    assert result.exit_code == 0, out
    data = json.loads(out)
    assert data["plan"]["boundaries"] == [0, 8, 15, 22, 26]
    assert Plan.load(dest).boundaries == (0, 8, 15, 22, 26)
    before = dest.read_text()
    result, out = _run("plan", str(profile_path), "-s", "2", "--out", str(dest))
    assert result.exit_code == 1 and "--force" in out
    assert dest.read_text() == before
    result, out = _run("plan", str(profile_path), "-s", "2", "--out", str(dest), "--force")
    assert result.exit_code == 0, out
    assert Plan.load(dest).stages == 2


def test_compare_lists_every_baseline(profile_path) -> None:
    """--compare shows autopipe and the baselines with their ratio to autopipe."""
    result, out = _run("plan", str(profile_path), "-s", "4", "--compare", "--json")
    assert result.exit_code == 0, out
    rows = json.loads(out)["compare"]
    assert [r["method"] for r in rows] == ["autopipe", "uniform", "parameters", "torchtitan", "greedy"]
    assert all(r["step_time"] >= rows[0]["step_time"] for r in rows)
    result, out = _run("plan", str(profile_path), "-s", "4", "--compare")
    assert result.exit_code == 0 and "parameters" in out and "vs autopipe" in out


@pytest.mark.parametrize(
    "args,message",
    [
        (["--memory-limit", "80 gigs"], "bad memory size"),
        (["--memory-limit", "100MB"], "no cut into 4 stages"),
        (["--schedule", "pipedream"], "unknown schedule"),
        (["--boundaries", "0,a,26"], "--boundaries"),
        (["--boundaries", "0,3,3,20,26"], "empty"),
        (["--bandwidth", "0"], "bandwidth '0' must be more than 0 bytes per second"),
        (["--bandwidth", "fast"], "bad bandwidth 'fast'"),
        (["-m", "0"], "micro-batches must be at least 1, got 0"),
        (["--microbatches", "-3"], "micro-batches must be at least 1, got -3"),
        (["--schedule", "interleaved1f1b", "--virtual-stages", "0"], "virtual stages must be at least 1, got 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(profile_path, args, message) -> None:
    """Bad options print one 'error:' line naming the problem and exit 1."""
    result, out = _run("plan", str(profile_path), "--stages", "4", *args)
    assert result.exit_code == 1, out
    assert "error:" in out and message in out
    assert "Traceback" not in out


def test_missing_profile(tmp_path) -> None:
    """A missing profile file is an error, not a traceback."""
    result, out = _run("plan", str(tmp_path / "none.json"), "--stages", "2")
    assert result.exit_code == 1 and "no profile at" in out


def test_out_that_cannot_be_written_is_one_line(profile_path, tmp_path) -> None:
    """--out naming a folder (with --force) or a read-only place fails with one line and exit 1."""
    folder = tmp_path / "a_folder"
    folder.mkdir()
    result, out = _run("plan", str(profile_path), "-s", "2", "--out", str(folder), "--force")
    assert result.exit_code == 1, out
    assert "Traceback" not in out and out.count("error:") == 1
    assert f"error: cannot write {folder}: Is a directory" in out
    result, out = _run("plan", str(folder), "-s", "2")
    assert result.exit_code == 1 and "Traceback" not in out
    assert f"error: cannot access {folder}: Is a directory" in out


def test_stage_names_option(profile_path) -> None:
    """--stage-names takes module names per stage (stages split by ';', names by ','): a manual plan."""
    stages = [["wte"] + [f"h.{i}" for i in range(6)], [f"h.{i}" for i in range(6, 13)],
              [f"h.{i}" for i in range(13, 20)], [f"h.{i}" for i in range(20, 24)] + ["lm_head"]]  # fmt: skip
    text = "; ".join(", ".join(names) for names in stages)
    result, out = _run("plan", str(profile_path), "-s", "4", "--stage-names", text, "--json")
    assert result.exit_code == 0, out
    plan = json.loads(out)["plan"]
    assert plan["boundaries"] == [0, 7, 14, 21, 26] and plan["method"] == "manual"


@pytest.mark.parametrize(
    "text,message",
    [
        ("wte;h;;lm_head", "chunk 2 is empty"),
        ("wte;h", "stage_names has 2 chunks, expected 4"),
        ("wte;nope;h;lm_head", "'nope' (chunk 1) names no layer"),
    ],
)
def test_bad_stage_names_are_one_line(profile_path, text, message) -> None:
    """Stage names that do not make a cut print one error line and exit 1."""
    result, out = _run("plan", str(profile_path), "-s", "4", "--stage-names", text)
    assert result.exit_code == 1, out
    assert "Traceback" not in out and out.count("error:") == 1 and message in out


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("forward_time", -1, r"layer 3 \(h.2\) forward_time is -1, but must be a finite number >= 0"),
        ("activation_bytes", 1.5, r"layer 3 \(h.2\) activation_bytes is 1.5, but must be a whole number of bytes"),
        ("index", 7, r"layer 3 \(h.2\) has index 7"),
    ],
)
def test_a_hand_edited_profile_with_impossible_values_is_refused(profile_path, field, value, message) -> None:
    """A profile whose figures cannot be (a negative time, fractional bytes, a broken index) is refused on
    load with the layer and field named, exit 1 (it once printed a bubble of 270781% and exit 0)."""
    data = json.loads(profile_path.read_text())
    data["layers"][3][field] = value
    profile_path.write_text(json.dumps(data))
    result, out = _run("plan", str(profile_path), "--stages", "2")
    assert result.exit_code == 1 and "Traceback" not in out
    assert re.search(message, out), out
    assert len([line for line in out.splitlines() if line.strip()]) == 1


def test_plan_on_a_gpu_profile_holds_to_its_memory_and_says_what_recomputes(tmp_path) -> None:
    """A GPU profile's memory is the default limit; under it auto recompute picks a mode for the
    first stage and the summary names the limit's source and the recompute chosen, with its cost."""
    from dataclasses import replace

    from autopipe.costs.layer_costs import DeviceInfo

    prof = replace(Profile.from_costs([1.0] * 4, activation_bytes=[100] * 4, output_bytes=[10] * 4), input_bytes=10,
                   device=DeviceInfo(name="Test GPU", type="cuda", memory_bytes=350))  # fmt: skip
    path = tmp_path / "gpu.json"
    prof.save(path)
    result, out = _run("plan", str(path), "--stages", "2", "--microbatches", "4", "--bandwidth", "none")
    text = " ".join(out.split())
    assert result.exit_code == 0, out
    assert "of 350 B (the device's memory)" in text
    assert "recompute: full on chunk 0 (+666.667 ms per micro-batch at most)" in text
    small = tmp_path / "small-gpu.json"
    replace(prof, device=replace(prof.device, memory_bytes=250)).save(small)
    result, out = _run("plan", str(small), "--stages", "2", "--microbatches", "4", "--bandwidth", "none",
                       "--recompute", "none")  # fmt: skip
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1 and len(errors) == 1, out
    assert "fits the Test GPU's 250 B" in errors[0] and "(--recompute auto) would fit" in errors[0]
    result, out = _run("plan", str(path), "--stages", "2", "--microbatches", "4", "--bandwidth", "none",
                       "--memory-limit", "none")  # fmt: skip
    assert result.exit_code == 0 and "recompute:" not in out and "device's memory" not in out, out


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"stages": 3}, r"plan has 4 chunks \(boundaries \[0, 8, 15, 22, 26\]\) but stages 3 x virtual_stages 1 = 3"),
        ({"stage_ranks": [0, 1, 2, 7]}, r"plan stage_ranks\[3\] is 7, not a rank of its 4 stages"),
        ({"stage_times": [0.1, 0.1]}, r"plan stage_times has 2 entries for 4 chunks"),
        ({"rank_memory": [1, 2, 3]}, r"plan rank_memory has 3 entries for 4 stages"),
        ({"step_time": -1}, r"plan step_time is -1, but must be a finite number >= 0"),
        ({"stage_memory": [1, 2, 3.5, 4]}, r"plan stage_memory\[2\] is 3.5, but must be a whole number >= 0"),
        ({"microbatches": 0}, r"plan microbatches is 0, but must be a whole number >= 1"),
        ({"stage_recompute": ["none", "none", "some", "none"]}, r"plan stage_recompute\[2\] is 'some'"),
    ],
)
def test_a_hand_edited_plan_that_cannot_be_is_refused_on_load(profile_path, tmp_path, edit, message) -> None:
    """A plan whose stages disagree with its boundaries, whose per-chunk or per-rank lists have the wrong
    length, or whose figures cannot be: refused on load in one line naming the field, exit 1, by
    `autopipe report` and by train.py's load_plan (it once crashed with an IndexError, or told
    train.py's user to launch the plan's stage count)."""
    from autopipe.errors import RecordError
    from autopipe.runtime import load_plan

    plan_path = tmp_path / "plan.json"
    result, out = _run("plan", str(profile_path), "-s", "4", "--schedule", "1f1b", "--out", str(plan_path))
    assert result.exit_code == 0, out
    assert load_plan(plan_path).stages == 4  # as written, it loads
    data = json.loads(plan_path.read_text())
    data.update(edit)
    plan_path.write_text(json.dumps(data))
    result, out = _run("report", str(plan_path), "--profile", str(profile_path), "--out", str(tmp_path / "r.html"))
    assert result.exit_code == 1 and "Traceback" not in out, out
    assert len([line for line in out.splitlines() if line.strip()]) == 1 and re.search(message, out), out
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(RecordError, match=message):
        load_plan(plan_path)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_plan_the_partitioner_makes_loads_back(data) -> None:
    """The load-time checks refuse only what cannot be: any plan partition() makes (zero-cost layers,
    every schedule, a memory limit, baselines) round-trips through its JSON unchanged."""
    from autopipe import partition
    from autopipe.errors import InfeasibleMemoryError
    from autopipe.planner import compare_baselines

    schedule = data.draw(st.sampled_from(["gpipe", "1f1b", "interleaved1f1b", "zbv"]))
    v = 2 if schedule in ("interleaved1f1b", "zbv") else 1
    n = data.draw(st.integers(v, 9))
    stages = data.draw(st.integers(1, n // v))
    times = data.draw(st.lists(st.sampled_from([0.0, 1e-6, 0.001, 0.3, 2.0]), min_size=n, max_size=n))
    params = data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
    prof = Profile.from_costs(times, param_bytes=params, activation_bytes=[1000] * n, output_bytes=[500] * n)
    micro = stages * data.draw(st.integers(1, 2))
    limit = data.draw(st.one_of(st.none(), st.integers(10**5, 10**8)))
    try:
        plan = partition(prof, stages, schedule=schedule, microbatches=micro, memory_limit=limit,
                         bandwidth=data.draw(st.sampled_from([None, 1e9])))
    except InfeasibleMemoryError:
        return
    for p in [plan, *compare_baselines(prof, plan).values()]:
        assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))) == p
