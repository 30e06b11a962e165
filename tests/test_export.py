"""`autopipe export` and plans made for an engine: each file says exactly what the plan says.

- torchtitan: the form the release reads (0.2's TOML parses, 0.3's module is Python) with every module
  of the plan's chunks once, in order, in torchtitan's names (torchtitan itself reads them in
  tests/test_export_torchtitan.py and tests/test_export_titan022.py);
- Megatron-Core: the flags (Megatron-Core's own layout parser reads them in tests/test_export_megatron.py);
- DeepSpeed: the file imports nothing from autopipe and its parts are the plan's boundaries;
- a plan an engine cannot run is refused in one line that says which and what would work.
"""

from __future__ import annotations

import ast
import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopipe import Profile, partition
from autopipe.cli import app
from autopipe.costs.layer_costs import LayerCost
from autopipe.errors import AutopipeError, ExportError, PartitionError, RecordError
from autopipe.job.export import export_plan, stage_modules
from autopipe.planner.plan import Plan
from autopipe.planner.targets import allowed_cuts, default_cut, layer_units, module_cuts
from autopipe.report.tables import plan_summary

ROOT = Path(__file__).resolve().parent.parent
GPT2 = Profile.load(ROOT / "profiles" / "gpt2-cpu.json")  # tied wte = lm_head, 12 blocks
LLAMA = Profile.load(ROOT / "profiles" / "llama-7b-h100-estimate.json")  # untied, 32 blocks
runner = CliRunner()


def _profile(names: list[str], times: list[float] | None = None, tied: dict[int, str] | None = None) -> Profile:
    times = times or [1.0] * len(names)
    layers = tuple(LayerCost(i, n, t / 3, 2 * t / 3, params=100, param_bytes=400, grad_bytes=400,
                             tied=(tied[i],) if tied and i in tied else ())
                   for i, (n, t) in enumerate(zip(names, times)))  # fmt: skip
    return Profile(layers=layers, signature="sig", model="")


def _flags(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("--"):
            key, _, value = line.partition(" ")
            out[key] = value.strip('"')
    return out


# ---- torchtitan ----------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,name", [("1f1b", "1F1B"), ("gpipe", "GPipe"), ("interleaved1f1b", "Interleaved1F1B"),
                                           ("zbv", "ZBVZeroBubble")])
def test_torchtitan_02_toml_holds_every_module_of_each_chunk_once(schedule: str, name: str) -> None:
    """0.2's TOML parses; one part per virtual stage, in model order, holding exactly its chunk's modules
    in the names of torchtitan's HuggingFace backend (a HuggingFace Llama), rotary_emb in each."""
    plan = partition(LLAMA, 4, schedule=schedule, target="torchtitan", memory_limit=None)
    out = export_plan(plan, LLAMA, "torchtitan@0.2", path="pp.toml")
    cfg = tomllib.loads(out.text)
    par = cfg["parallelism"]
    assert par["pipeline_parallel_degree"] == 4 and par["pipeline_parallel_schedule"] == name
    assert par["pipeline_parallel_microbatch_size"] == 1
    assert cfg["training"]["local_batch_size"] == plan.microbatches  # micro-batches = local batch / micro-batch size
    assert cfg["activation_checkpoint"] == {"mode": "none"}  # written although none: 0.2's default is selective
    assert cfg["model"] == {"name": "transformers_modeling_backend", "flavor": "full"}
    parts = par["module_fqns_per_model_part"]
    assert len(parts) == plan.num_chunks
    rename = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "lm_head": "output"}
    for c, part in enumerate(parts):
        want = [rename.get(u, u.removeprefix("model.")) for i in plan.layers_of(c) for u in layer_units(LLAMA.layers[i].name)
                if u != "model.rotary_emb"]
        assert [m for m in part if m != "rotary_emb"] == want and part.count("rotary_emb") == 1
    assert "--parallelism.pipeline_parallel_schedule " + name in out.overrides
    assert out.args[-2:] == ("--activation_checkpoint.mode", "none") and out.filename == "pp.toml"


def test_torchtitan_03_module_sets_the_plan_on_the_models_config_function() -> None:
    """0.3's module: the HF backend's config function, every field, and recompute none said explicitly."""
    plan = partition(LLAMA, 4, target="torchtitan", dp=2, zero=3, recompute="full", memory_limit=None)
    out = export_plan(plan, LLAMA, "torchtitan@0.3")
    tree = ast.parse(out.text)  # torchtitan itself reads it in tests/test_export_torchtitan.py
    assert [f.name for f in tree.body if isinstance(f, ast.FunctionDef)] == ["autopipe_plan"]
    assert "transformers_modeling_backend_full as base_config" in out.text
    assert "cfg.parallelism.data_parallel_shard_degree = 2" in out.text and "FullAC.Config()" in out.text
    assert out.args[-1] == "activation-checkpoint:full" and "--training.disable_cuda_graphs" in out.args
    assert out.filename == "autopipe_plan.py" and "--module autopipe_plan --config autopipe_plan" in out.command
    assert any("hf_model" in step for step in out.todo)  # a built-in has no folder: the user names the model


def test_the_torchtitan_release_decides_the_form_and_a_wrong_one_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed 0.2.x -> TOML; none installed -> 0.3; 0.4 or a version on another engine refused; a
    file name the release cannot read refused, naming the one it can."""
    from autopipe.job.export import titan_names

    plan = partition(LLAMA, 2, target="torchtitan", memory_limit=None)
    monkeypatch.setattr(titan_names, "installed_titan", lambda: "0.2.2")
    assert export_plan(plan, LLAMA, "torchtitan").suffix == ".toml"
    monkeypatch.setattr(titan_names, "installed_titan", lambda: None)
    assert export_plan(plan, LLAMA, "torchtitan").version == "0.3"
    for target, says in [("torchtitan@0.4", "writes torchtitan 0.2's TOML and 0.3's config function"),
                         ("megatron@0.16", "only torchtitan takes a version")]:
        with pytest.raises(ExportError) as e:
            export_plan(plan, LLAMA, target)
        assert says in _one_line(e)
    with pytest.raises(ExportError) as e:
        export_plan(plan, LLAMA, "torchtitan@0.3", path="pp.toml")
    assert "reads no TOML" in _one_line(e) and "torchtitan@0.2" in str(e.value)
    with pytest.raises(ExportError) as e:
        export_plan(plan, LLAMA, "torchtitan@0.3", path="export.torchtitan.py")
    assert "like one, e.g. autopipe_plan.py" in _one_line(e)


def test_a_module_torchtitans_splitter_would_drop_is_refused() -> None:
    """GPT-2's transformer.h.3 is two levels down: torchtitan would keep nothing of it, so say so."""
    prof = _profile(["transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"])
    plan = partition(prof, 2, target="torchtitan", bandwidth=None)
    with pytest.raises(ExportError) as e:
        export_plan(plan, prof, "torchtitan")
    assert "would silently drop transformer.wte" in _one_line(e) and "--to fqns or deepspeed" in str(e.value)


def test_with_the_model_every_stage_gets_the_rotary_embedding_and_no_dropout() -> None:
    """Built on meta, the model says which parameter-free modules every stage calls (rotary, not dropout)."""
    from autopipe.graph.sources import load_model

    model = load_model("llama-7b", device="meta", seq_len=16).model
    plan = partition(LLAMA, 4, target="torchtitan", memory_limit=None)
    sm = stage_modules(plan, LLAMA, "torchtitan", model)
    assert sm.every_stage == ("model.rotary_emb",) and all("model.rotary_emb" in m for m in sm.modules)
    gpt = load_model("gpt2", device="meta", seq_len=16).model
    sm = stage_modules(partition(GPT2, 2, target="deepspeed"), GPT2, "fqns", gpt)
    assert sm.every_stage == () and sm.modules[0][:3] == ("transformer.wte", "transformer.wpe", "transformer.drop")
    assert sm.tied == ((("lm_head.weight", "transformer.wte.weight"), (0, 1)),)


# ---- DeepSpeed -------------------------------------------------------------------------------------

def test_deepspeed_file_stands_alone_and_its_parts_are_the_plans() -> None:
    """The file imports no autopipe; PARTS are the plan's boundaries; parts_for maps any layer list."""
    plan = partition(GPT2, 3, target="deepspeed")
    text = export_plan(plan, GPT2, "deepspeed").text
    assert "autopipe" not in "".join(line for line in text.splitlines() if "import" in line)
    ns: dict = {}
    exec(compile(text, "ds_pipeline.py", "exec"), ns)  # the wrapper imports DeepSpeed only when called
    assert ns["PARTS"] == list(plan.boundaries) and ns["NUM_STAGES"] == 3
    assert ns["parts_for"](ns["STAGE_MODULES"], ns["LAYER_MODULES"]) == list(plan.boundaries)
    assert ns["DS_CONFIG"]["gradient_accumulation_steps"] == plan.microbatches
    # a user's own list: embedding split in two, a reshape with no module, one layer per block
    mine = ["transformer.wte", ["transformer.wpe", "transformer.drop"], None] + \
        [f"transformer.h.{i}" for i in range(12)] + ["transformer.ln_f", "lm_head"]
    parts = ns["parts_for"](ns["STAGE_MODULES"], mine)
    assert parts[0] == 0 and parts[-1] == len(mine)
    assert [parts[s] - 3 + 1 for s in (1, 2)] == list(plan.boundaries[1:3])  # three entries stand for layer 0
    with pytest.raises(ValueError, match="on stages"):
        ns["parts_for"](ns["STAGE_MODULES"], ["transformer"])
    with pytest.raises(ValueError, match="no stage lists"):
        ns["parts_for"](ns["STAGE_MODULES"], ["encoder.block.0"])


# ---- fqns -------------------------------------------------------------------------------------------

def test_fqns_json_lists_stages_ranks_and_ties() -> None:
    plan = partition(GPT2, 2, schedule="zbv", target="fqns")
    data = json.loads(export_plan(plan, GPT2, "fqns").text)
    assert [s["rank"] for s in data["stages"]] == list(plan.stage_ranks) == [0, 1, 1, 0]
    assert [s["layers"] for s in data["stages"]] == [list(p) for p in zip(plan.boundaries, plan.boundaries[1:])]
    assert data["tied"][0]["stages"] == [0, 3]


# ---- what cannot be expressed: one line each --------------------------------------------------------

LEAF = ["transformer.wte", "transformer.wpe"] + [f"transformer.h.{b}.{p}" for b in range(3) for p in ("attn", "mlp")] + \
    ["transformer.ln_f", "lm_head"]


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_a_cut_inside_a_module_is_refused_naming_it() -> None:
    prof = _profile(LEAF)
    plan = partition(prof, 2, boundaries=[0, 3, len(LEAF)])  # starts a chunk at transformer.h.0.mlp
    with pytest.raises(ExportError) as e:
        export_plan(plan, prof, "torchtitan")
    msg = _one_line(e)
    assert "inside module transformer.h.0" in msg and "--for torchtitan" in msg
    assert set(partition(prof, 3, target="torchtitan").boundaries[1:-1]) <= {1, 2, 4, 6, 8, 9}


def test_tied_weights_across_stages_are_refused_for_torchtitan_only() -> None:
    plan = partition(GPT2, 2, target="deepspeed")
    with pytest.raises(ExportError) as e:
        export_plan(plan, GPT2, "torchtitan")
    msg = _one_line(e)
    assert "does not tie weights across stages" in msg and "--to megatron or deepspeed" in msg
    export_plan(plan, GPT2, "megatron")  # Megatron ties the embedding to the output layer
    with pytest.raises(PartitionError) as e:
        partition(GPT2, 2, target="torchtitan")
    assert "untie them" in _one_line(e)


@pytest.mark.parametrize("target,schedule,says", [
    ("megatron", "zbv", "Megatron-Core has no zbv schedule; plan with --schedule 1f1b or interleaved1f1b."),
    ("megatron", "gpipe", "Megatron-Core has no gpipe schedule"),
    ("deepspeed", "interleaved1f1b", "DeepSpeed has no interleaved1f1b schedule; plan with --schedule 1f1b."),
])
def test_a_schedule_the_engine_lacks_is_refused(target: str, schedule: str, says: str) -> None:
    plan = partition(LLAMA, 2, schedule=schedule, memory_limit=None)
    with pytest.raises(ExportError) as e:
        export_plan(plan, LLAMA, target)
    assert says in _one_line(e)
    with pytest.raises(ExportError, match=says.split(";")[0]):
        partition(LLAMA, 2, schedule=schedule, target=target, memory_limit=None)


def test_sharding_and_mixed_recompute_the_engine_lacks_are_refused() -> None:
    plan = partition(LLAMA, 4, dp=2, zero=3, memory_limit=None)
    with pytest.raises(ExportError) as e:
        export_plan(plan, LLAMA, "megatron")
    assert "no ZeRO 3" in _one_line(e) and "--zero 0 or 1 or 2" in str(e.value)
    plan = replace(partition(LLAMA, 4, memory_limit=None), stage_recompute=("none", "full", "none", "none"))
    with pytest.raises(ExportError) as e:
        export_plan(plan, LLAMA, "torchtitan")
    assert "applies one recompute mode to every stage; plan with --recompute full or none" in _one_line(e)


def test_megatron_refuses_cuts_inside_e_or_l_and_non_decoder_models() -> None:
    plan = partition(GPT2, 2, boundaries=[0, 14, 15])  # ln_f | lm_head
    with pytest.raises(ExportError) as e:
        export_plan(plan, GPT2, "megatron")
    assert "inside Megatron-Core's final norm, output layer and loss (L)" in _one_line(e)
    t5 = _profile(["encoder.embed_tokens", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm",
                   "decoder.embed_tokens", "decoder.block.0", "decoder.block.1", "decoder.final_layer_norm", "lm_head"])
    with pytest.raises(ExportError) as e:
        partition(t5, 2, target="megatron")
    assert "one decoder stack" in _one_line(e)


def test_a_plan_from_another_profile_is_refused() -> None:
    plan = partition(LLAMA, 2, memory_limit=None)
    with pytest.raises(AutopipeError, match="another profile"):
        export_plan(plan, GPT2, "fqns")


# ---- the planner's side: allowed cuts, what the restriction costs, the plan record ----------------

def test_allowed_cuts_per_target() -> None:
    names = ["wte, wpe, drop", "h.0", "h.1.attn", "h.1.mlp", "h.2", "ln_f", "lm_head"]
    assert module_cuts(names) == (1, 2, 4, 5, 6)
    assert allowed_cuts(names, "megatron").cuts == (1, 2, 4, 5)
    assert allowed_cuts(names, "torchtitan", tied=[[0, 6]]).cuts == ()
    assert allowed_cuts(names, "deepspeed", tied=[[0, 6]]).cuts == (1, 2, 4, 5, 6)
    assert layer_units("transformer.h.0..transformer.h.2") == ("transformer.h.0", "transformer.h.1", "transformer.h.2")
    two = ["wte, wpe", "h.0..h.1", "h.2..h.3", "ln_f", "lm_head"]  # two blocks per layer: four decoder layers
    plan = partition(_profile(two), 2, target="megatron", bandwidth=None)
    assert _flags(export_plan(plan, _profile(two), "megatron").text)["--num-layers"] == "4"  # Megatron reads it: test_export_megatron


def test_torchtitans_default_split_is_its_formula() -> None:
    """32 layers on 4 stages, embedding and norm+output weighing a layer each: 1+8 | 9 | 8 | 7+1."""
    names = [layer.name for layer in LLAMA.layers]
    bounds, _ = default_cut("torchtitan", names, [1.0] * len(names), 4)
    assert bounds == (0, 9, 18, 26, 35)
    assert default_cut("megatron", names, [1.0] * len(names), 4)[0] == (0, 9, 17, 25, 35)


def test_a_restricted_plan_records_what_the_restriction_costs() -> None:
    """Cuts allowed only between whole blocks: the plan keeps to them and reports the unrestricted step."""
    prof = _profile(LEAF, times=[1, 1, 2, 9, 2, 9, 2, 9, 1, 3])
    plan = partition(prof, 3, target="fqns", bandwidth=None)
    free = partition(prof, 3, bandwidth=None)
    assert set(plan.boundaries[1:-1]) <= set(plan.allowed_cuts) and plan.target == "fqns"
    assert plan.unrestricted_step_time == pytest.approx(free.step_time)
    assert plan.restriction_cost is not None and plan.restriction_cost > 0
    assert f"+{plan.restriction_cost:.2%}" in plan_summary(plan)
    from autopipe.report.page import render_report

    assert f"+{plan.restriction_cost:.1%} vs" in render_report(plan, prof)  # the report's facts say it too
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert back == plan
    old = {k: v for k, v in free.to_dict().items() if k not in ("target", "allowed_cuts", "unrestricted_step_time",
                                                                "unrestricted_boundaries")}  # fmt: skip
    assert Plan.from_dict(old).allowed_cuts is None  # plans from before the fields still load
    bad = {**plan.to_dict(), "boundaries": list(free.boundaries)}
    if free.boundaries != plan.boundaries:
        with pytest.raises(RecordError, match="allowed_cuts exclude"):
            Plan.from_dict(bad)


def test_the_layout_search_keeps_to_what_the_engine_runs() -> None:
    from autopipe.cluster.layout_search import search
    from autopipe.cluster.topology import cluster_for

    res = search(LLAMA, cluster_for("h100", 8, 8), global_batch=16, target="deepspeed", top=3)
    assert res.layouts and all(x.schedule == "1f1b" and x.virtual_stages == 1 and x.zero in (0, 1) for x in res.layouts)
    assert res.plan is not None and res.plan.target == "deepspeed"


# ---- the command line --------------------------------------------------------------------------------

def test_plan_for_then_export_writes_files_and_refuses_to_overwrite(tmp_path: Path) -> None:
    prof = tmp_path / "profile.json"
    LLAMA.save(prof)
    r = runner.invoke(app, ["plan", str(prof), "-s", "4", "--for", "megatron", "--out", str(tmp_path / "plan.json")],
                      env={"COLUMNS": "200"})  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "cut only where megatron can" in " ".join(r.output.split())
    out = tmp_path / "layout.sh"
    r = runner.invoke(app, ["export", str(tmp_path), "--to", "megatron", "--out", str(out), "--no-model"])
    assert r.exit_code == 0, r.output
    assert "Megatron-Core's even split" in r.output and "--pipeline-model-parallel-layout" in out.read_text()
    before = out.read_text()
    r = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "--to", "fqns", "--out", str(out), "--no-model"])
    assert r.exit_code == 1 and "--force" in r.output and out.read_text() == before
    r = runner.invoke(app, ["export", str(tmp_path / "plan.json"), "--to", "zbv", "--no-model"])
    assert r.exit_code == 1 and r.output.count("\n") == 1 and "unknown target" in r.output
    r = runner.invoke(app, ["plan", str(prof), "-s", "2", "--schedule", "zbv", "--for", "megatron"])
    assert r.exit_code == 1 and "no zbv schedule" in r.output


def test_megatron_ties_only_the_embedding_to_the_output_layer() -> None:
    names = ["embed", "layers.0", "layers.1", "layers.2", "norm", "head"]
    prof = _profile(names, tied={1: "shared.weight", 3: "shared.weight"})  # two decoder layers share a tensor
    plan = partition(prof, 2, target="deepspeed", bandwidth=None)
    with pytest.raises(ExportError) as e:
        export_plan(plan, prof, "megatron")
    assert "ties only the embedding to the output layer" in _one_line(e)
    export_plan(plan, prof, "deepspeed")  # DeepSpeed ties any tensor (TiedLayerSpec)


def test_names_that_are_not_the_models_modules_are_refused() -> None:
    from autopipe.graph.sources import load_model

    gpt = load_model("gpt2", device="meta", seq_len=16).model
    with pytest.raises(ExportError) as e:
        stage_modules(partition(LLAMA, 2, target="fqns", memory_limit=None), LLAMA, "fqns", gpt)
    assert "model.embed_tokens, which is not a module of the model" in _one_line(e)

