"""convert's options as one record (ConvertSettings): checked in one place, a misspelled one named,
the same plan either way it is given; and emit keeps every file it is asked to write."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from _factories import net_factory_source

from autopipe.errors import AutopipeError
from autopipe.job.converter import convert
from autopipe.job.folder import JobSettings, emit
from autopipe.job.settings import ConvertSettings


@pytest.fixture()
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A 6-layer factory file in a fresh working directory (jobs/ lands there too)."""
    (tmp_path / "tiny.py").write_text(net_factory_source(batch_size=4))
    monkeypatch.chdir(tmp_path)
    return "tiny.py:build"


def test_settings_normalise_the_spellings_a_person_uses() -> None:
    """Precision and schedule aliases become the canonical names; DeepSpeed plans without recompute."""
    s = ConvertSettings(stages=2, dtype="bfloat16", schedule="1F1B")
    assert (s.dtype, s.schedule, s.recompute) == ("bf16", "1f1b", "auto")
    assert ConvertSettings(stages=2, engine="deepspeed").recompute == "none"
    assert ConvertSettings(gpus=8, global_batch=64).stages is None  # the search chooses
    assert ConvertSettings(stages=2, schedule="zbv").chunks_per_stage == 2
    with pytest.raises(Exception, match="frozen|cannot assign"):
        s.stages = 3  # type: ignore[misc]


@pytest.mark.parametrize(("options", "message"), [
    ({}, "give --stages N (the cut for N stages) or --gpus N"),
    ({"stages": 0}, "--stages must be at least 1, got 0."),
    ({"stages": 2, "microbatches": 0}, "--microbatches must be at least 1, got 0."),
    ({"stages": 2, "engine": "megatron"}, "unknown engine 'megatron'; use one of torch, deepspeed, auto."),
    ({"stages": 2, "dtype": "fp8"}, "unknown dtype 'fp8'; use fp32, bf16 or fp16."),
    ({"stages": 2, "schedule": "zigzag"}, "unknown schedule 'zigzag'"),
    ({"stages": 2, "engine": "deepspeed", "schedule": "zbv"}, "--schedule zbv does not run on --engine deepspeed"),
    ({"stages": 2, "engine": "deepspeed", "dtype": "fp16"}, "--dtype fp16 does not run on --engine deepspeed"),
    ({"stages": 2, "memory_limit": "lots"}, "bad memory size 'lots'"),
    ({"stages": 2, "recompute": "some"}, "unknown --recompute 'some'; use one of none, auto, selective, full."),
    ({"stages": 2, "engine": "deepspeed", "recompute": "full"}, "--recompute full does not run on --engine deepspeed"),
    ({"stages": 2, "dp": 0}, "dp=0: the data-parallel replicas must be a whole number >= 1."),
    ({"stages": 2, "dp": 2, "zero": 5}, "zero=5; use a ZeRO stage 0, 1, 2 or 3, or 'auto'."),
    ({"stages": 2, "dp": 2, "zero": 2, "engine": "deepspeed"}, "--zero 2 does not run on --engine deepspeed"),
    ({"stages": 2, "device": "h100"}, "--device 'h100' can only be measured as cpu or cuda; add --estimate for h100."),
    ({"stages": 2, "device": "tpu", "estimate": True}, "unknown --device 'tpu'; use cpu or cuda"),
    ({"stages": 2, "gpus": 4}, "--stages fixes what --gpus searches; give one or the other."),
    ({"gpus": 4}, "--gpus needs --global-batch N"),
])
def test_each_bad_option_is_refused_in_one_line(options: dict, message: str) -> None:
    """Every cheap check is the record's: the messages convert gave before it was a record."""
    with pytest.raises(AutopipeError) as err:
        ConvertSettings(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_misspelled_option_names_the_one_meant(factory: str, tmp_path: Path) -> None:
    """convert(**options) refuses a typo before any work, naming the closest option; nothing is written."""
    with pytest.raises(AutopipeError, match="unknown convert option 'microbatch'; did you mean 'microbatches'"):
        convert(factory, stages=2, microbatch=4, out=tmp_path / "job")
    with pytest.raises(AutopipeError, match="unknown convert option 'gpu'; did you mean 'gpus'"):
        convert(factory, ConvertSettings(stages=2), gpu=4)
    with pytest.raises(AutopipeError, match="unknown convert option 'xyzzy'; use one of bandwidth_inter"):
        convert(factory, stages=2, xyzzy=1)
    assert not (tmp_path / "job").exists() and not Path("jobs").exists()


def test_a_record_and_keywords_make_the_same_job(factory: str) -> None:
    """convert(model, settings) and convert(model, **options) cut alike and write the same files;
    keywords given with a record replace its fields; on_pass sees each pass in order."""
    seen: list[str] = []
    asked = ConvertSettings(stages=3, microbatches=4, schedule="gpipe", estimate=True, reserve=0, out="a", progress=False)
    a = convert(factory, asked, on_pass=seen.append)
    b = convert(factory, stages=3, microbatches=4, schedule="gpipe", estimate=True, reserve=0, out="b", progress=False)
    c = convert(factory, asked, out="c", stages=2)
    assert seen == ["load", "flatten", "profile", "partition", "emit"] == list(a.seconds)
    assert a.options == asked and c.options == replace(asked, out="c", stages=2)
    assert a.plan.boundaries == b.plan.boundaries and a.plan.stages == 3 and c.plan.stages == 2
    assert a.settings == replace(b.settings) and a.settings.schedule == "gpipe"
    for name in ("plan.json", "train.py"):
        assert (Path("a") / name).read_text() == (Path("b") / name).read_text(), name
    readme_b = (Path("b") / "README.md").read_text().replace("b/train.py", "a/train.py").replace("run b ", "run a ")
    assert (Path("a") / "README.md").read_text() == readme_b


def test_deepspeed_job_keeps_its_search(tmp_path: Path) -> None:
    """emit with a cluster search and engine deepspeed writes plan.search.json beside ds_config.json
    (it used to reset the file list for DeepSpeed and leave the search behind)."""
    from autopipe.cluster.layout_search import search
    from autopipe.cluster.layouts import SearchResult
    from autopipe.cluster.topology import cluster_for
    from autopipe.costs.layer_costs import Profile

    prof = Profile.from_costs(times=[1e-3] * 6, param_bytes=[4000] * 6)
    found = search(prof, cluster_for("cpu", 4, None, None, None), global_batch=8, memory_limit=None,
                   recompute="none", zeros=(0, 1), schedules=(("1f1b", 1),))  # fmt: skip
    plan = found.plan
    settings = JobSettings(model="tiny.py:build", stages=plan.stages, microbatches=plan.microbatches,
                           schedule=plan.schedule, engine="deepspeed")  # fmt: skip
    job = emit(tmp_path / "job", settings=settings, profile=prof, plan=plan, search=found)
    names = sorted(p.name for p in job.files)
    assert names == sorted(["plan.json", "profile.json", "train.py", "report.html", "README.md", "plan.search.json",
                            "ds_config.json"])  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "job").iterdir()) == names
    loaded = SearchResult.load(str(tmp_path / "job" / "plan.search.json"))
    assert loaded.best == found.best and loaded.layouts == found.layouts and loaded.best.stages == plan.stages
    assert json.loads((tmp_path / "job" / "ds_config.json").read_text())["zero_optimization"]["stage"] == plan.zero
