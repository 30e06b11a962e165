"""`autopipe report --breakdown`: a bench's measured step breakdown beside the plan's own terms."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopipe.cli import app
from autopipe.costs.layer_costs import Profile
from autopipe.errors import AutopipeError
from autopipe.planner import partition
from autopipe.report.breakdown import plan_terms, read_breakdowns

runner = CliRunner()


def _plan():
    return partition(Profile.from_costs([0.01, 0.04, 0.04, 0.03]), stages=2, microbatches=4)


def test_plan_terms_add_up_each_ranks_chunks_times_the_microbatches() -> None:
    plan = _plan()
    terms = plan_terms(plan)
    assert len(terms) == 2
    for r, t in enumerate(terms):
        assert t["forward"] == pytest.approx(plan.stage_forward[r] * 4)
        assert t["backward"] == pytest.approx(plan.stage_backward[r] * 4)
        assert t["forward"] + t["backward"] + t["p2p"] == pytest.approx(plan.rank_times[r] * 4)


def test_report_shows_the_breakdown_and_refuses_a_bad_file_in_one_line(tmp_path: Path) -> None:
    plan = _plan()
    plan.save(tmp_path / "plan.json")
    good = tmp_path / "b.json"
    good.write_text(json.dumps([{"method": "autopipe torch", "ranks": [{"forward": 0.123, "p2p": 0.01, "step": 0.5},
                                                                      {"forward": 0.2, "step": 0.5}]}]))
    r = runner.invoke(app, ["report", str(tmp_path / "plan.json"), "--breakdown", str(good)])
    assert r.exit_code == 0, r.output
    page = (tmp_path / "report.html").read_text()
    assert "Where a step went" in page and "autopipe torch" in page and "123" in page
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(AutopipeError, match="not a step breakdown"):
        read_breakdowns(bad)
    r = runner.invoke(app, ["report", str(tmp_path / "plan.json"), "--breakdown", str(bad), "--force"])
    assert r.exit_code != 0 and "not a step breakdown" in r.output and "Traceback" not in r.output
