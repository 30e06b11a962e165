"""`autopipe plan --gpus` and `autopipe convert --gpus`: the cluster search from the command line,
its files, and one-line errors (CliRunner)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _factories import net_factory_source
from typer.testing import CliRunner

from autopipe import Profile
from autopipe.cli import app
from autopipe.cluster.layouts import SearchResult
from autopipe.job.script import read_settings
from autopipe.planner.plan import Plan

runner = CliRunner()


@pytest.fixture
def profile_path(tmp_path):
    names = ["wte"] + [f"h.{i}" for i in range(8)] + ["lm_head"]
    times = [0.001] + [0.010] * 8 + [0.020]
    params = [4_000_000] + [2_000_000] * 8 + [4_000_000]
    path = tmp_path / "profile.json"
    prof = Profile.from_costs(times, param_bytes=params, activation_bytes=[1_000_000] * 10,
                              output_bytes=[100_000] * 9 + [0], names=names)
    prof.save(path)
    return path


def _run(*args: str):
    result = runner.invoke(app, list(args), env={"COLUMNS": "250"})
    return result, result.output


def _one_error_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out
    return lines[0]


def test_plan_gpus_searches_and_saves_the_best(profile_path, tmp_path) -> None:
    """--gpus prints the best layouts and the counts, saves the best plan (with its replicas) and
    the layouts beside it; the report built from the plan shows the search's front."""
    dest = tmp_path / "plan.json"
    result, out = _run("plan", str(profile_path), "--gpus", "4", "--gpus-per-node", "2", "--global-batch", "8",
                       "--memory-limit", "120MB", "--out", str(dest))
    assert result.exit_code == 0, out
    assert "best layouts of 4 devices (2 per node), global batch 8" in out
    assert "searched" in out and "pruned by the throughput bound" in out
    # This profile has no tp shapes: the search says, after its tables, that it searched tp 1 only.
    assert out.rstrip().splitlines()[-1].startswith("note: tp 1 only")
    plan = Plan.load(dest)
    found = SearchResult.load(str(tmp_path / "plan.search.json"))
    best = found.layouts[0]
    assert (plan.stages, plan.dp, plan.microbatches, plan.zero) == (best.stages, best.dp, best.microbatches, best.zero)
    assert plan.stages * plan.dp == 4 and best.global_batch == 8
    assert plan.peak_memory <= 120_000_000
    result, out = _run("report", str(dest), "--profile", str(profile_path))
    assert result.exit_code == 0, out
    html = (tmp_path / "report.html").read_text()
    assert "Cluster search: throughput against peak memory" in html and "<circle" in html


def test_plan_gpus_json(profile_path) -> None:
    """--json prints the search and the best plan."""
    result, out = _run("plan", str(profile_path), "--gpus", "2", "--gpus-per-node", "2", "--global-batch", "4",
                       "--memory-limit", "none", "--json")
    assert result.exit_code == 0, out
    data = json.loads(out)
    assert data["search"]["kind"] == "autopipe.search" and data["plan"]["stages"] * data["plan"]["dp"] == 2


def test_out_is_never_overwritten_without_force(profile_path, tmp_path) -> None:
    """An existing plan or layouts file is refused in one line and left as it was; --force replaces both."""
    dest = tmp_path / "plan.json"
    dest.write_text("mine")
    args = ("plan", str(profile_path), "--gpus", "2", "--gpus-per-node", "2", "--global-batch", "4", "--out", str(dest))
    result, out = _run(*args)
    assert result.exit_code == 1 and "--force" in _one_error_line(out)
    assert dest.read_text() == "mine"
    dest.unlink()
    (tmp_path / "plan.search.json").write_text("mine too")
    result, out = _run(*args)
    assert result.exit_code == 1 and "plan.search.json exists" in _one_error_line(out)
    assert not dest.exists()
    result, out = _run(*args, "--force")
    assert result.exit_code == 0, out
    assert SearchResult.load(str(tmp_path / "plan.search.json")).gpus == 2


@pytest.mark.parametrize("args, expected", [
    (("--gpus", "4"), "--gpus needs --global-batch"),
    (("--gpus", "4", "--global-batch", "8", "--stages", "2"), "--stages fixes what --gpus searches"),
    (("--gpus", "6", "--gpus-per-node", "4", "--global-batch", "8"), "whole number of nodes"),
    ((), "give --stages N"),
    (("--gpus", "4", "--gpus-per-node", "2", "--global-batch", "8", "--memory-limit", "10MB"),
     "no layout of 4 devices fits 9.54 MiB per device for a global batch of 8"),
])
def test_bad_search_options_are_one_line(profile_path, args, expected) -> None:
    """Each mistake gets one line naming it (and what would fit), exit 1."""
    result, out = _run("plan", str(profile_path), *args)
    assert result.exit_code == 1
    assert expected in _one_error_line(out)


def test_convert_gpus_emits_the_best_layout(tmp_path, monkeypatch) -> None:
    """convert --gpus (estimated on meta: nothing runs) writes the best layout's job: plan.json with
    its replicas, the layouts, a report with the front, and a launch of stages x dp processes (train.py
    takes the replicas and the ZeRO stage from the plan)."""
    monkeypatch.chdir(tmp_path)
    factory = tmp_path / "tiny.py"
    factory.write_text(FACTORY)
    result = runner.invoke(app, ["convert", f"{factory}:build", "--gpus", "4", "--gpus-per-node", "4",
                                 "--global-batch", "8", "--estimate", "--memory-limit", "none",
                                 "--bandwidth-intra", "1MB", "--reserve", "80MiB", "--out", "job"], env={"COLUMNS": "250"})  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("job/plan.json").read_text())
    dp, stages = plan["dp"], plan["stages"]
    assert dp * stages == 4
    launch = "torchrun --nproc-per-node 4 job/train.py"
    assert launch in result.output and launch in Path("job/README.md").read_text()
    assert SearchResult.load("job/plan.search.json").layouts[0].stages == stages
    assert read_settings("job/train.py")["dp"] == dp
    assert "Cluster search" in Path("job/report.html").read_text()


FACTORY = net_factory_source(batch_size=1)


def test_a_model_tp_shards_nothing_gets_no_tp(tmp_path, monkeypatch) -> None:
    """The MLP above is single Linears, no colwise→rowwise pair and no HF tp_plan: the runtime would run
    every layer whole on each tp rank. convert --tp 2 says so in one line (nothing written), and
    --gpus searches no tp degree for it (it used to price each Linear as a divided colwise matmul and
    pick tp 4 on 4 devices)."""
    monkeypatch.chdir(tmp_path)
    factory = tmp_path / "tiny.py"
    factory.write_text(FACTORY)
    result = runner.invoke(app, ["convert", f"{factory}:build", "--stages", "1", "--tp", "2", "--estimate",
                                 "--reserve", "0", "--out", "job"], env={"COLUMNS": "250"})  # fmt: skip
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "tensor parallelism shards no weight of this model" in result.output and not Path("job").exists()
    result = runner.invoke(app, ["convert", f"{factory}:build", "--gpus", "4", "--gpus-per-node", "4", "--global-batch",
                                 "8", "--estimate", "--memory-limit", "none", "--reserve", "0", "--out", "job2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(Path("job2/plan.json").read_text()).get("tp", 1) == 1
    assert all(layout.tp == 1 for layout in SearchResult.load("job2/plan.search.json").layouts)
