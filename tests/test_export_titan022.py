"""torchtitan 0.2 (the last release that reads TOML) itself reads `autopipe export --to torchtitan@0.2`.

The release runs in a subprocess (tests/_titan022_check.py), from a folder pip filled with it alone
(the ``titan022`` fixture), so it is torchtitan 0.2.2's own ConfigManager that reads the TOML, its own
train spec that builds the model the TOML names, and its own ``pipeline_module_split`` that builds
each rank's parts: they hold the plan's chunks, every parameter once, the head under 0.2's name
``output``; the recompute mode is the plan's, written although it is "none" (0.2's default is
selective); and the printed overrides on top of a config naming only the model read the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autopipe
from autopipe import Profile, partition
from autopipe.costs.layer_costs import LayerCost
from autopipe.graph.sources import load_model
from autopipe.job.export import export_plan
from autopipe.planner.targets import layer_units

pytestmark = pytest.mark.slow  # a subprocess importing torchtitan: seconds

HERE = Path(__file__).resolve().parent
SPEC = "torchtitan:llama3:debugmodel"


def _run_022(titan022: str, toml: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([titan022, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(HERE / "_titan022_check.py"), str(toml), *args], env=env, cwd=toml.parent,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def llama3() -> Profile:
    ms = load_model(SPEC, device="meta", batch_size=2, seq_len=64)
    seq = autopipe.flatten(ms.model, ms.args, ms.kwargs)
    heavy = {1: 4.0, 7: 3.0}  # a costly first block and norm: not torchtitan's even split
    return Profile(layers=tuple(LayerCost(i, info.name, heavy.get(i, 1.0) / 3, 2 * heavy.get(i, 1.0) / 3, params=10)
                                for i, info in enumerate(seq.infos)),
                   signature=seq.signature, model=SPEC, microbatch={"input_ids": [2, 64]})  # fmt: skip


@pytest.mark.parametrize("schedule,recompute", [("interleaved1f1b", "none"), ("1f1b", "full")])
def test_torchtitan_02_reads_the_toml_and_splits_its_llama3_as_planned(titan022: str, llama3: Profile, tmp_path: Path,
                                                                        schedule: str, recompute: str) -> None:  # fmt: skip
    plan = partition(llama3, 2, schedule=schedule, microbatches=4, target="torchtitan", recompute=recompute,
                     bandwidth=None)  # fmt: skip
    toml = tmp_path / "pp.toml"
    out = export_plan(plan, llama3, "torchtitan@0.2", path=toml)
    toml.write_text(out.text)
    got = _run_022(titan022, toml)
    assert got["version"] == "0.2.2" and got["model"] == ["llama3", "debugmodel"]
    p = got["parallelism"]
    assert p["pipeline_parallel_degree"] == 2 and p["pipeline_parallel_microbatch_size"] == 2
    assert got["training"] == {"local_batch_size": 8, "seq_len": 64}  # 4 micro-batches of the profile's 2 samples
    assert got["activation_checkpoint"] == recompute
    held = {}
    for rank, pairs in got["ranks"].items():
        for stage, names in pairs:
            assert plan.stage_ranks[stage] == int(rank)
            held[stage] = sorted({".".join(n.split(".")[:2]) if n.startswith("layers.") else n.split(".")[0] for n in names})
    rename = {"lm_head": "output"}
    want = [sorted(rename.get(u, u) for i in plan.layers_of(c) for u in layer_units(llama3.layers[i].name))
            for c in range(plan.num_chunks)]  # fmt: skip
    assert [held[c] for c in range(plan.num_chunks)] == want
    names = [n for pairs in got["ranks"].values() for _, ns in pairs for n in ns]
    assert sorted(names) == sorted(got["params"])  # every parameter in exactly one part
    if recompute != "none":
        return  # the overrides once: each run of 0.2.2 costs seconds
    # the same plan as overrides on a config that names only the model
    bare = tmp_path / "model.toml"
    bare.write_text('[model]\nname = "llama3"\nflavor = "debugmodel"\n')
    again = _run_022(titan022, bare, *out.args)
    assert again["parallelism"] == p and again["training"] == got["training"]
    assert again["activation_checkpoint"] == recompute
