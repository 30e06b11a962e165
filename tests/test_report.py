"""report.html: one self-contained page; its content is checked by parsing it (no browser here)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopipe import AutopipeError, Profile, partition
from autopipe.cli import app
from autopipe.planner import compare_baselines
from autopipe.planner.baselines import BASELINES
from autopipe.report.page import render_report, write_report
from autopipe.units import format_time

runner = CliRunner()


class _Page(HTMLParser):
    """Collects every start tag with its attributes, and the text."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, {k: v or "" for k, v in attrs}))

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def all(self, tag: str, cls: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and (cls is None or cls in a.get("class", "").split())]


def _profile() -> Profile:
    # Eight layers of known cost; layer 5 is heavy, so the cut is not uniform.
    times = [1.0, 1.0, 1.0, 1.0, 1.0, 4.0, 1.0, 2.0]
    return Profile.from_costs(times, param_bytes=[100] * 8, activation_bytes=[10] * 8, output_bytes=[8] * 8,
                              names=[f"block.{i}" for i in range(8)])


def test_report_shows_each_stage_and_cut():
    """The stage table has one row per stage and the layer charts mark exactly the plan's cuts."""
    prof = _profile()
    plan = partition(prof, 3, bandwidth=None)
    page = _Page(render_report(plan, prof))
    assert len(page.all("tr", "stage")) == 3
    cuts = {int(a["data-cut"]) for a in page.all("line", "cut")}
    assert cuts == set(plan.boundaries[1:-1])
    # two per-layer charts (time, memory), each with one bar group per layer, coloured by its stage
    layers = page.all("g", "layer")
    assert len(layers) == 2 * 8
    owner = {int(a["data-layer"]): int(a["data-stage"]) for a in layers}
    assert [owner[i] for i in range(8)] == [c for c in range(3) for _ in plan.layers_of(c)]


def test_report_is_self_contained():
    """No script, stylesheet link, image or URL: it reads offline; charts are inline SVG."""
    prof = _profile()
    text = render_report(partition(prof, 2), prof)
    page = _Page(text)
    assert len(page.all("svg")) >= 5
    assert not page.all("script") and not page.all("link") and not page.all("img") and not page.all("iframe")
    assert "http" not in text and "@import" not in text and "//" not in re.sub(r"<!DOCTYPE html>", "", text)
    assert all(u == "url(#idle)" for u in re.findall(r"url\([^)]*\)", text))


def test_timeline_has_every_operation_and_idle_rows():
    """The schedule chart draws each forward and backward of each micro-batch on each rank."""
    prof = _profile()
    plan = partition(prof, 3, microbatches=5, schedule="1f1b")
    page = _Page(render_report(plan, prof))
    ops = page.all("g", "op")
    assert len(ops) == 2 * 5 * 3
    assert sum(a["data-kind"] == "F" for a in ops) == 15
    assert len(page.all("rect", "idle")) == 3
    assert f"bubble {plan.bubble_fraction:.0%}" in "".join(page.text)


def test_baselines_are_compared_and_over_limit_marked():
    """autopipe's plan sits beside every baseline; one that breaks the memory limit is marked."""
    # The first layers hold much memory and little time: balancing parameters or layer counts
    # crowds them into one stage, over the limit that autopipe's cut respects (1600 B static and 400 B
    # of AdamW step temporaries per heavy layer).
    prof = Profile.from_costs([1, 1, 1, 1, 3, 3, 3, 3], param_bytes=[400, 400, 400, 400, 1, 1, 1, 1])
    plan = partition(prof, 2, memory_limit=4100, bandwidth=None)
    baselines = compare_baselines(prof, plan)
    assert set(baselines) == set(BASELINES)
    page = _Page(render_report(plan, prof, baselines=baselines))
    methods = [a["data-method"] for a in page.all("tr", "method")]
    assert methods == ["autopipe", *BASELINES]
    over = [m for m, p in baselines.items() if p.peak_memory > 4100]
    assert over  # the fixture makes at least one baseline break the limit
    assert render_report(plan, prof, baselines=baselines).count("over limit") == len(over)


def test_report_without_profile_leaves_out_layer_charts():
    """With only a plan, the stage, memory and timeline charts are drawn; per-layer ones are not."""
    plan = partition(_profile(), 2)
    page = _Page(render_report(plan))
    assert not page.all("g", "layer") and not page.all("tr", "method")
    assert len(page.all("tr", "stage")) == 2 and page.all("svg", "timeline")


def test_report_refuses_a_profile_of_another_model():
    """A profile whose layer count differs from the plan's is an error naming both counts."""
    plan = partition(_profile(), 2)
    with pytest.raises(AutopipeError, match="6 layers but the plan cuts 8"):
        render_report(plan, Profile.from_costs([1.0] * 6))


def test_format_time_picks_a_unit():
    """Times read as µs, ms or s with three significant digits."""
    assert [format_time(t) for t in (0, 2.5e-5, 0.0123, 0.5, 7.919)] == ["0", "25 µs", "12.3 ms", "500 ms", "7.92 s"]


def test_report_command_rebuilds_from_plan_and_sibling_profile(tmp_path: Path):
    """`autopipe report plan.json` finds profile.json beside it and writes report.html there."""
    prof = _profile()
    plan = partition(prof, 2)
    plan.save(tmp_path / "plan.json")
    prof.save(tmp_path / "profile.json")
    result = runner.invoke(app, ["report", str(tmp_path / "plan.json")])
    assert result.exit_code == 0, result.output
    page = _Page((tmp_path / "report.html").read_text())
    assert len(page.all("g", "layer")) == 16 and len(page.all("tr", "stage")) == 2


def test_report_command_writes_to_out_without_profile(tmp_path: Path):
    """--out chooses the file; with no profile it says what it left out."""
    partition(_profile(), 2).save(tmp_path / "plan.json")
    result = runner.invoke(app, ["report", str(tmp_path / "plan.json"), "--out", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    assert "no profile" in result.output and (tmp_path / "r.html").exists()


def test_report_command_bad_plan_is_one_line(tmp_path: Path):
    """A file that is not a plan gives exit code 1 and one error line, no traceback."""
    (tmp_path / "plan.json").write_text('{"kind": "something else"}')
    result = runner.invoke(app, ["report", str(tmp_path / "plan.json")])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert [l for l in result.output.splitlines() if l.strip()] == ["error: not an autopipe plan (missing kind 'autopipe.plan')."]


def test_write_report_replaces_the_file_whole(tmp_path: Path):
    """write_report leaves one complete file and no temporary file beside it."""
    prof = _profile()
    path = write_report(tmp_path / "report.html", partition(prof, 2), prof)
    assert path.read_text().rstrip().endswith("</html>")
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


def test_atomic_writes_leave_no_temporary_file_when_the_target_is_a_folder(tmp_path: Path):
    """A plan, profile or report aimed at a folder fails with the target named, and leaves no temporary file."""
    from autopipe.files import write_text_atomic

    (tmp_path / "taken").mkdir()
    prof = _profile()
    for write in (lambda p: write_text_atomic(p, "text"), lambda p: partition(prof, 2).save(p), prof.save,
                  lambda p: write_report(p, partition(prof, 2), prof)):
        with pytest.raises(IsADirectoryError, match=r"cannot write \S*taken: Is a directory"):
            write(tmp_path / "taken")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_baselines_use_the_plans_optimizer(tmp_path: Path):
    """A plan made for SGD records it; the report's baselines are then counted with SGD, not the profile's AdamW."""
    prof = _profile()  # AdamW: 100 B of parameters hold 400 B static; SGD: 200 B
    plan = partition(prof, 2, optimizer="sgd")
    assert plan.optimizer == "sgd" and partition(prof, 2).optimizer == "adamw"
    plan.save(tmp_path / "plan.json")
    loaded = type(plan).load(tmp_path / "plan.json")
    assert loaded == plan
    for method, other in compare_baselines(prof, loaded).items():
        assert other.optimizer == "sgd"
        assert other.peak_memory == partition(prof, 2, optimizer="sgd", method=method).peak_memory
    assert compare_baselines(prof, loaded)["uniform"].peak_memory < partition(prof, 2, method="uniform").peak_memory


def test_plan_without_optimizer_field_still_loads(tmp_path: Path):
    """A plan.json written before the optimizer was recorded loads, taking the profile's optimizer."""
    import json

    plan = partition(_profile(), 2)
    data = plan.to_dict()
    del data["optimizer"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    old = type(plan).load(tmp_path / "plan.json")
    assert old.optimizer is None
    assert compare_baselines(_profile(), old)["uniform"].optimizer == "adamw"


def test_report_command_refuses_to_overwrite_out_without_force(tmp_path: Path):
    """--out naming an existing file is refused (file kept) unless --force; the default beside the plan is rebuilt."""
    partition(_profile(), 2).save(tmp_path / "plan.json")
    mine = tmp_path / "notes.html"
    mine.write_text("my notes")
    result = runner.invoke(app, ["report", str(tmp_path / "plan.json"), "--out", str(mine)])
    assert result.exit_code == 1 and "--force" in result.output and "Traceback" not in result.output
    assert mine.read_text() == "my notes"
    result = runner.invoke(app, ["report", str(tmp_path / "plan.json"), "--out", str(mine), "--force"])
    assert result.exit_code == 0, result.output
    assert mine.read_text().rstrip().endswith("</html>")
    for _ in range(2):  # the plan's own report.html is what `report` rebuilds: no --force needed
        result = runner.invoke(app, ["report", str(tmp_path / "plan.json")])
        assert result.exit_code == 0, result.output


def test_report_command_sets_a_step_log_beside_the_predictions(tmp_path: Path):
    """`autopipe report plan.json --log log.json`: median step time (after the first step) and each rank's
    largest peak, beside the plan's, with their ratios; a ratio off by more than 10% is marked."""
    import json

    prof = _profile()
    plan = partition(prof, 2)
    plan.save(tmp_path / "plan.json")
    prof.save(tmp_path / "profile.json")
    mem = plan.rank_memory
    steps = [  # step 1 is warm-up; then step times 1.0, 1.1, 1.2 x the plan's
        {"step": 1, "step_time": 50 * plan.step_time, "peak_memory": [10 * mem[0], 10 * mem[1]]},
        {"step": 2, "step_time": 1.0 * plan.step_time, "peak_memory": [mem[0], int(1.5 * mem[1])]},
        {"step": 3, "step_time": 1.1 * plan.step_time, "peak_memory": [mem[0], mem[1]]},
        {"step": 4, "step_time": 1.2 * plan.step_time, "peak_memory": [mem[0], mem[1]]},
    ]
    (tmp_path / "log.json").write_text("\n".join(json.dumps(s) for s in steps) + "\n")
    result = runner.invoke(app, ["report", str(tmp_path / "plan.json"), "--log", str(tmp_path / "log.json")])
    assert result.exit_code == 0, result.output
    assert "measured / predicted: step 1.10, peak memory per rank 1.00 1.50" in result.output
    page = (tmp_path / "report.html").read_text()
    assert "Measured against predicted" in page and "<td class=over>1.50</td>" in page and "<td>1.10</td>" in page


def test_report_command_refuses_a_file_that_is_not_a_step_log(tmp_path: Path):
    """--log with another JSON file: one line saying what it wants."""
    partition(_profile(), 2).save(tmp_path / "plan.json")
    (tmp_path / "log.json").write_text('{"boundaries": [0, 4, 8]}\n')
    result = runner.invoke(app, ["report", str(tmp_path / "plan.json"), "--log", str(tmp_path / "log.json")])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "is not a step record" in result.output


def test_report_repeats_the_profile_s_warnings():
    """What the profiler doubted (identical layers that disagreed) is at the top of the report."""
    import dataclasses

    prof = dataclasses.replace(_profile(), warnings=("identical layers h.0 and h.7 measured 3 and 30 ms",))
    page = render_report(partition(prof, 2), prof)
    assert "warning: identical layers h.0 and h.7 measured 3 and 30 ms" in page


def test_report_breaks_down_each_rank_s_memory_and_shows_recompute():
    """Each rank's predicted peak by what holds it, summing to the rank's memory; stages that
    recompute say the mode and its cost per micro-batch."""
    prof = Profile.from_costs([1.0] * 4, activation_bytes=[100] * 4, output_bytes=[10] * 4)
    plan = partition(prof, 2, microbatches=4, bandwidth=None, memory_limit=350)
    assert plan.stage_recompute == ("full", "none")
    page = _Page(render_report(plan, prof))
    text = " ".join(" ".join(page.text).split())
    assert page.all("table", "rank-memory")
    for r, d in enumerate(plan.rank_memory_breakdown):
        assert d["total"] == plan.rank_memory[r]
        parts = sum(v for k, v in d.items() if k != "total")
        assert d["total"] <= parts  # the peak takes the larger of the backward and data-parallel phases
    assert "saved activations × in flight" in text and "runtime reserve" not in text  # no reserve in this profile
    assert "full, +666.67 ms" in text.replace("  ", " ") or "full, +667 ms" in text, text[:2000]
    assert "1 of 2 stages" in text
