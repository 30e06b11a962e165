"""docs/export.md's worked examples run as written, and each engine's own code reads what they write.

The ``autopipe ...`` lines of each example (section "Worked examples, one per engine") run through the
CLI in a fresh folder; then torchtitan 0.3 (ConfigManager, builder, splitter per rank) and 0.2.2 (in
its subprocess) read the torchtitan files, bash expands the Megatron file's PIPELINE_ARGS and
megatron-core parses the layout, and the DeepSpeed file maps a DeepSpeed user's own GPT-2 layers.
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopipe import Profile
from autopipe.cli import app
from autopipe.planner.plan import Plan
from autopipe.planner.targets import layer_units

pytestmark = pytest.mark.slow  # three models profiled and the engines imported: tens of seconds

DOC = Path(__file__).resolve().parent.parent / "docs" / "export.md"
runner = CliRunner()


def _examples() -> dict[str, list[list[str]]]:
    """Per engine (the word after "### "), the autopipe command lines of its worked example."""
    text = DOC.read_text().split("## Worked examples", 1)[1].split("\n## ", 1)[0]
    out: dict[str, list[list[str]]] = {}
    for section in text.split("\n### ")[1:]:
        engine = section.split(":", 1)[0].strip()
        out[engine] = [shlex.split(line.strip()) for line in section.splitlines() if line.startswith("    autopipe ")]
    return out


def _run(engine: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.chdir(folder)
    said = []
    for argv in _examples()[engine]:
        result = runner.invoke(app, argv[1:], env={"COLUMNS": "400"})
        assert result.exit_code == 0, (argv, result.output)
        said.append(result.output)
    return "\n".join(said)


def _planned_units(folder: Path) -> list[list[str]]:
    prof, plan = Profile.load(folder / "profile.json"), Plan.load(folder / "plan.json")
    return [[u for i in plan.layers_of(c) for u in layer_units(prof.layers[i].name)] for c in range(plan.num_chunks)]


def test_every_engine_has_a_worked_example() -> None:
    assert {k: len(v) >= 3 for k, v in _examples().items()} == {"torchtitan": True, "Megatron-Core": True, "DeepSpeed": True}


def test_the_torchtitan_example_is_read_by_torchtitan_03_and_02(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                titan022: str) -> None:  # fmt: skip
    from _titan_check import build_model, parse_module, split_per_rank, units_of_core_chunk
    from test_export_titan022 import _run_022

    said = _run("torchtitan", tmp_path, monkeypatch)
    assert "-m torchtitan.train --module autopipe_plan --config autopipe_plan" in said
    assert "-m torchtitan.train --job.config_file pp.toml" in said
    want = _planned_units(tmp_path)
    plan = Plan.load(tmp_path / "plan.json")
    cfg = parse_module(tmp_path / "autopipe_plan.py")
    split = split_per_rank(build_model(cfg), cfg)
    held = {stage: sorted(units_of_core_chunk(chunk)) for rank, pairs in split.items() for stage, chunk in pairs
            if plan.stage_ranks[stage] == rank}  # fmt: skip
    assert [held[c] for c in range(plan.num_chunks)] == [sorted(w) for w in want]
    got = _run_022(titan022, tmp_path / "pp.toml")
    names = [n for pairs in got["ranks"].values() for _, ns in pairs for n in ns]
    assert sorted(names) == sorted(got["params"]) and got["activation_checkpoint"] == "none"


def test_the_megatron_example_is_read_by_megatron_core(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    said = _run("Megatron-Core", tmp_path, monkeypatch)
    assert "pretrain_gpt.py --hidden-size 256 --ffn-hidden-size 688 --num-attention-heads 8" in said
    # the arguments as pretrain_gpt.py receives them: bash expands the array
    argv = subprocess.run(["bash", "-c", 'source pipeline_args.sh && printf "%s\\n" "${PIPELINE_ARGS[@]}"'],
                          cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    flag = {a: b for a, b in zip(argv, argv[1:]) if a.startswith("--")}
    pp = int(flag["--pipeline-model-parallel-size"])
    layout = PipelineParallelLayerLayout(flag["--pipeline-model-parallel-layout"].strip('"'), pp)
    layout.validate_layer_layout(num_layers=int(flag["--num-layers"]), mtp_num_layers=None)
    want = [[int(u.rpartition(".")[2]) for u in units if u.startswith("model.layers.")] for units in _planned_units(tmp_path)]
    assert [layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=0, pp_rank=r) for r in range(pp)] == want


def test_the_deepspeed_example_maps_a_deepspeed_users_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said = _run("DeepSpeed", tmp_path, monkeypatch)
    assert "deepspeed --num_gpus 2" in said
    spec = importlib.util.spec_from_file_location("ds_pipeline", tmp_path / "ds_pipeline.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    mine = ["transformer.wte", ["transformer.wpe", "transformer.drop"]] + [f"transformer.h.{i}" for i in range(12)] + \
        ["transformer.ln_f", "lm_head"]
    parts = ds.parts_for(ds.STAGE_MODULES, mine)
    plan = Plan.load(tmp_path / "plan.json")
    assert ds.PARTS == list(plan.boundaries) and len(parts) == plan.stages + 1 and parts[-1] == len(mine)
