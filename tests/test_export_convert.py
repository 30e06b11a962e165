"""`autopipe convert --for ENGINE`: the job's plan cuts only where that engine can, and the job folder
holds the engine's export beside plan.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopipe.cli import app
from autopipe.job import ConvertSettings
from autopipe.planner.targets import module_cuts

runner = CliRunner()


@pytest.mark.slow
def test_convert_for_torchtitan_cuts_between_modules_and_writes_its_config(tmp_path: Path) -> None:
    """A Llama job planned for torchtitan: every cut at a module boundary, the plan says its target,
    and the installed torchtitan's config (0.3: the module autopipe_plan.py) names each stage's modules."""
    out = tmp_path / "job"
    result = runner.invoke(app, ["convert", "llama-tiny", "--stages", "2", "--estimate", "--device", "h100",
                                 "--seq-len", "32", "--for", "torchtitan", "--out", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    profile = json.loads((out / "profile.json").read_text())
    names = [layer["name"] for layer in profile["layers"]]
    assert plan["target"] == "torchtitan"
    assert set(plan["boundaries"][1:-1]) <= set(module_cuts(names))
    text = (out / "autopipe_plan.py").read_text()
    assert "def autopipe_plan():" in text and "cfg.parallelism.module_fqns_per_model_part" in text
    assert '"layers.0"' in text and "model.layers" not in text  # torchtitan's HuggingFace backend's names
    assert "autopipe_plan.py" in result.output


def test_an_unknown_target_is_refused_before_any_work() -> None:
    """A misspelled engine fails when the settings are made, naming the ones there are."""
    with pytest.raises(Exception, match="unknown target 'torchtitn'"):
        ConvertSettings(stages=2, target="torchtitn")
