"""`autopipe convert`: a job folder from a model in one command, and one clear line for each bad input."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _factories import net_factory_source
from typer.testing import CliRunner

import autopipe.costs.profiler as profiler
from autopipe.cli import app
from autopipe.job.script import read_settings

runner = CliRunner()

FACTORY = net_factory_source(batch_size=4)


@pytest.fixture()
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A factory file in a fresh working directory (jobs/ lands there too)."""
    (tmp_path / "tiny.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    return "tiny.py:build"


def _convert(*args: str):
    return runner.invoke(app, ["convert", *args, "--repeats", "1"])


def _error_lines(output: str) -> list[str]:
    return [l for l in output.splitlines() if l.startswith("error:")]


def _fails_cleanly(result, expected: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = _error_lines(result.output)
    assert len(errors) == 1, result.output
    assert expected in errors[0], errors[0]


@pytest.mark.slow  # measures every layer of the model
def test_convert_writes_the_job_folder(factory: str):
    """Success: plan, profile, train.py, report and README in jobs/<name>, a stage table and the launch command."""
    result = _convert(factory, "--stages", "2")
    assert result.exit_code == 0, result.output
    job = Path("jobs/tiny-build")
    assert sorted(p.name for p in job.iterdir()) == ["README.md", "plan.json", "profile.json", "report.html", "train.py"]
    plan = json.loads((job / "plan.json").read_text())
    # 2 stages of one chunk each, or two under the interleaved schedule or zbv (--schedule auto's choice)
    assert plan["kind"] == "autopipe.plan" and plan["stages"] == 2 and len(plan["boundaries"]) == 2 * plan["virtual_stages"] + 1
    assert read_settings(job / "train.py")["schedule"] == plan["schedule"]
    assert plan["boundaries"][0] == 0 and plan["boundaries"][-1] == 6  # inp, 4 blocks, out
    profile = json.loads((job / "profile.json").read_text())
    assert profile["model"] == factory and len(profile["layers"]) == 6
    assert "torchrun --nproc-per-node 2 jobs/tiny-build/train.py" in result.output
    names = [layer["name"] for layer in profile["layers"]]
    for a in plan["boundaries"][:-1]:  # the stage table names each chunk's first layer
        assert names[a] in result.output
    assert (job / "train.py").stat().st_size > 0
    assert "torchrun --nproc-per-node 2 jobs/tiny-build/train.py" in (job / "README.md").read_text()


def test_convert_estimate_and_options_reach_the_plan(factory: str):
    """--estimate builds on meta; --out, --microbatches, --schedule and --memory-limit reach plan.json."""
    result = _convert(factory, "--stages", "3", "--estimate", "--microbatches", "4", "--schedule", "gpipe",
                      "--memory-limit", "1GiB", "--reserve", "8MiB", "--out", "elsewhere/job")  # (no probe: test_reserve)
    assert result.exit_code == 0, result.output
    plan = json.loads(Path("elsewhere/job/plan.json").read_text())
    assert (plan["microbatches"], plan["schedule"], plan["memory_limit"]) == (4, "gpipe", 2**30)
    profile = json.loads(Path("elsewhere/job/profile.json").read_text())
    assert (profile["mode"], profile["reserve_bytes"]) == ("estimated", 8 * 2**20)
    assert "torchrun --nproc-per-node 3 elsewhere/job/train.py" in result.output


def test_unknown_model_is_one_line(factory: str):
    """An unknown model name fails with exit 1 and one line listing what MODEL may be."""
    _fails_cleanly(_convert("gtp2", "--stages", "2"), "unknown model 'gtp2'")
    assert not Path("jobs").exists()


def test_more_stages_than_layers_is_one_line(factory: str, monkeypatch: pytest.MonkeyPatch):
    """More stages than layers is found right after flatten, before any profiling; nothing is written."""
    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled although the stages cannot fit the layers")

    monkeypatch.setattr(profiler, "profile", no_profiling)
    _fails_cleanly(_convert(factory, "--stages", "7"), "flattens into 6 layers, too few for 7 stages")
    _fails_cleanly(_convert(factory, "--stages", "4", "--schedule", "zbv"), "6 layers, too few for 4 stages (2 chunks")
    assert not Path("jobs").exists()


def test_memory_infeasible_is_one_line(factory: str):
    """A memory limit no cut fits is refused with the memory that would fit; nothing is written."""
    _fails_cleanly(_convert(factory, "--stages", "2", "--memory-limit", "1KiB", "--reserve", "0"), "no cut into 2 stages")
    assert not Path("jobs").exists()


def test_limit_below_the_reserve_is_one_line(factory: str):
    """A limit the runtime's own reserve already uses up is refused naming the reserve; nothing is written."""
    _fails_cleanly(_convert(factory, "--stages", "2", "--memory-limit", "1MiB", "--reserve", "2MiB"),
                   "the runtime itself holds 2.00 MiB per rank")  # fmt: skip
    assert not Path("jobs").exists()


def test_bad_memory_limit_is_one_line(factory: str):
    """A memory limit without a readable size says how to write one."""
    _fails_cleanly(_convert(factory, "--stages", "2", "--memory-limit", "lots"), "bad memory size 'lots'")


def test_bad_schedule_and_engine_are_one_line(factory: str):
    """Unknown schedule and engine names are refused before any work."""
    _fails_cleanly(_convert(factory, "--stages", "2", "--schedule", "zigzag"), "unknown schedule 'zigzag'")
    _fails_cleanly(_convert(factory, "--stages", "2", "--engine", "megatron"), "unknown engine 'megatron'")


def test_existing_folder_is_not_overwritten(factory: str):
    """An existing job folder is refused and left exactly as it was."""
    job = Path("jobs/tiny-build")
    job.mkdir(parents=True)
    (job / "plan.json").write_text("my precious plan")
    _fails_cleanly(_convert(factory, "--stages", "2"), "already exists")
    assert (job / "plan.json").read_text() == "my precious plan"
    assert [p.name for p in job.iterdir()] == ["plan.json"]


def test_force_replaces_job_files_but_keeps_others(factory: str):
    """--force rewrites the job's own files; other files in the folder (a checkpoint) survive."""
    job = Path("jobs/tiny-build")
    (job / "checkpoints").mkdir(parents=True)
    (job / "checkpoints" / "step1.pt").write_text("weights")
    (job / "plan.json").write_text("old")
    result = _convert(factory, "--stages", "2", "--force")
    assert result.exit_code == 0, result.output
    assert json.loads((job / "plan.json").read_text())["kind"] == "autopipe.plan"
    assert (job / "checkpoints" / "step1.pt").read_text() == "weights"


def test_out_pointing_at_a_file_is_one_line(factory: str):
    """--out naming an existing file is refused and the file kept."""
    Path("notes.txt").write_text("keep")
    _fails_cleanly(_convert(factory, "--stages", "2", "--out", "notes.txt"), "is a file, not a folder")
    assert Path("notes.txt").read_text() == "keep"


def _fake_train_script(job_dir: Path, settings, plan) -> Path:
    """Stands in for the runtime's train.py writer, so the emit tests do not depend on it."""
    target = job_dir / "train.py"
    target.write_text("# train.py (test stand-in)\n")
    return target


def test_failure_while_writing_leaves_no_folder(factory: str, monkeypatch: pytest.MonkeyPatch):
    """If writing the job fails midway (the report here), the error is shown and the folders convert created are removed."""
    import autopipe.job.folder

    def broken(*args, **kwargs):
        raise autopipe.job.folder.AutopipeError("disk full (simulated)")

    monkeypatch.setattr(autopipe.job.folder, "_write_train_script", _fake_train_script)
    monkeypatch.setattr(autopipe.job.folder, "write_report", broken)
    _fails_cleanly(_convert(factory, "--stages", "2", "--out", "new/deep/job"), "disk full (simulated)")
    assert not Path("new").exists()


def test_force_failing_midway_keeps_the_old_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """With force, a failure while writing leaves the old job files and the checkpoints as they were."""
    import autopipe.job.folder
    from autopipe import Profile, partition
    from autopipe.job.folder import JOB_FILES, JobSettings, emit

    job = tmp_path / "jobs" / "tiny"
    (job / "checkpoints").mkdir(parents=True)
    (job / "checkpoints" / "step1.pt").write_text("weights")
    for name in JOB_FILES:
        (job / name).write_text(f"old {name}")
    prof = Profile.from_costs([1.0, 2.0, 1.0, 2.0])
    plan = partition(prof, 2)
    settings = JobSettings(model="tiny.py:build", stages=2, microbatches=plan.microbatches, schedule=plan.schedule)

    def broken(*args, **kwargs):
        raise autopipe.job.folder.AutopipeError("disk full (simulated)")

    monkeypatch.setattr(autopipe.job.folder, "_write_train_script", _fake_train_script)
    monkeypatch.setattr(autopipe.job.folder, "write_report", broken)
    with pytest.raises(autopipe.job.folder.AutopipeError, match="disk full"):
        emit(job, settings=settings, profile=prof, plan=plan, force=True)
    assert {name: (job / name).read_text() for name in JOB_FILES} == {name: f"old {name}" for name in JOB_FILES}
    assert (job / "checkpoints" / "step1.pt").read_text() == "weights"
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == ["tiny"]  # no staging folder left

    monkeypatch.undo()
    monkeypatch.setattr(autopipe.job.folder, "_write_train_script", _fake_train_script)
    files = emit(job, settings=settings, profile=prof, plan=plan, force=True)
    assert json.loads((job / "plan.json").read_text())["kind"] == "autopipe.plan"
    assert sorted(p.name for p in files.files) == sorted(JOB_FILES)
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == ["tiny"]
    assert (job / "checkpoints" / "step1.pt").read_text() == "weights"


@pytest.mark.parametrize(
    "model,expected",
    [
        ("gpt2", "gpt2"),
        ("llama-1b", "llama-1b"),
        ("models/Llama-3.2-1B", "Llama-3.2-1B"),
        ("models/Llama-3.2-1B/", "Llama-3.2-1B"),
        ("mypkg.nets.resnet:build", "resnet-build"),
        ("tiny.py:build", "tiny-build"),
        ("src/v1.2/my.models.py:build", "my.models-build"),
    ],
)
def test_default_job_dir_names(model: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """jobs/<name>: a folder's last component (dots kept); for a factory its module's last part or its
    file's stem, and the function's name."""
    from autopipe.job.converter import default_job_dir

    monkeypatch.chdir(tmp_path)
    assert default_job_dir(model) == Path("jobs") / expected
    if "/" in model and ":" not in model:  # the same for a folder that exists
        Path(model).mkdir(parents=True)
        assert default_job_dir(model) == Path("jobs") / expected


def test_readme_names_a_quoted_train_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A job folder with a space in its path gets a README whose commands quote it whole."""
    import autopipe.job.folder
    from autopipe import Profile, partition
    from autopipe.job.folder import JobSettings, emit

    monkeypatch.setattr(autopipe.job.folder, "_write_train_script", _fake_train_script)
    prof = Profile.from_costs([1.0, 2.0, 1.0, 2.0])
    plan = partition(prof, 2)
    settings = JobSettings(model="tiny.py:build", stages=2, microbatches=plan.microbatches, schedule=plan.schedule)
    job = tmp_path / "my jobs" / "tiny"
    files = emit(job, settings=settings, profile=prof, plan=plan)
    readme = (job / "README.md").read_text()
    script = str(job / "train.py")
    assert files.launch == f"torchrun --nproc-per-node 2 '{script}'"
    assert f"`python '{script}' --help`" in readme


LOGITS = '''
import torch
from torch import nn


def build(batch_size=4):
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)), (torch.randn(batch_size, 16),)
'''


def test_a_job_without_a_loss_is_refused_before_profiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A model returning logits under --loss model (auto) is refused in one line naming the fix, before
    any profiling; --loss cross_entropy makes the job, with the loss and data in train.py's settings."""
    (tmp_path / "logits.py").write_text(LOGITS)
    monkeypatch.chdir(tmp_path)
    real = profiler.profile

    def no_profiling(*args, **kwargs):
        raise AssertionError("profiled a job that cannot train")

    monkeypatch.setattr(profiler, "profile", no_profiling)
    _fails_cleanly(_convert("logits.py:build", "--stages", "2"), "no scalar loss: train it with --loss cross_entropy")
    _fails_cleanly(_convert("logits.py:build", "--stages", "2", "--loss", "cross_entropy", "--data", "missing.npz"),
                   "--data 'missing.npz' does not exist")
    import numpy as np

    np.savez("wide.npz", x=np.zeros((8, 17), np.float32), y=np.zeros(8, np.int64))
    _fails_cleanly(_convert("logits.py:build", "--stages", "2", "--loss", "cross_entropy", "--data", "wide.npz"),
                   "takes (16,) per row")
    assert not Path("jobs").exists()
    monkeypatch.setattr(profiler, "profile", real)
    np.savez("good.npz", x=np.zeros((8, 16), np.float32), y=np.zeros(8, np.int64))
    result = _convert("logits.py:build", "--stages", "2", "--loss", "cross_entropy", "--data", "good.npz")
    assert result.exit_code == 0, result.output
    script = read_settings("jobs/logits-build/train.py")
    assert script["loss"] == "cross_entropy" and script["data"] == str(tmp_path / "good.npz")
    assert script["model"] == str(tmp_path / "logits.py") + ":build"  # runs from any folder


def test_deepspeed_job_gets_an_editable_ds_config_and_a_torchrun_launch(factory: str):
    """--engine deepspeed: ds_config.json in the job folder (batch sizes, optimizer, ZeRO), launched with torchrun."""
    result = _convert(factory, "--stages", "2", "--engine", "deepspeed", "--batch-size", "4")
    assert result.exit_code == 0, result.output
    cfg = json.loads(Path("jobs/tiny-build/ds_config.json").read_text())
    assert cfg["train_micro_batch_size_per_gpu"] == 4 and cfg["optimizer"]["type"] == "AdamW"
    assert cfg["zero_optimization"]["stage"] == 0
    assert "torchrun --nproc-per-node 2 jobs/tiny-build/train.py" in result.output
    _fails_cleanly(_convert(factory, "--stages", "2", "--engine", "deepspeed", "--schedule", "zbv", "--out", "x"),
                   "--schedule zbv does not run on --engine deepspeed")


def test_deepspeed_jobs_are_planned_without_recompute(factory: str):
    """DeepSpeed's engine recomputes nothing a plan asks for: its jobs are planned under --recompute none
    (the default auto would let a chunk count on recompute), a forced mode is refused in one line, and
    train.py on DeepSpeed refuses a plan that recomputes unless told to run it without."""
    from types import SimpleNamespace

    from autopipe.errors import AutopipeError
    from autopipe.planner.stage_plan import StagePlan
    from autopipe.runtime.deepspeed_engine.settings import refuse_plan as _refuse_plan

    assert _convert(factory, "--stages", "2", "--out", "t").exit_code == 0
    assert json.loads(Path("t/plan.json").read_text())["recompute"] == "auto"
    assert _convert(factory, "--stages", "2", "--engine", "deepspeed", "--out", "d").exit_code == 0
    plan = json.loads(Path("d/plan.json").read_text())
    assert plan["recompute"] == "none" and set(plan["stage_recompute"]) == {"none"}
    _fails_cleanly(_convert(factory, "--stages", "2", "--engine", "deepspeed", "--recompute", "full", "--out", "x"),
                   "--recompute full does not run on --engine deepspeed")
    assert not Path("x").exists()
    recomputing = StagePlan((0, 2, 4), recompute=("full", "none"))
    with pytest.raises(AutopipeError, match=r"plan.json recomputes activations \(full none\).*--recompute none"):
        _refuse_plan(recomputing, "plan.json", SimpleNamespace(recompute="plan"))
    _refuse_plan(recomputing, "plan.json", SimpleNamespace(recompute="none"))  # asked to run it without
    _refuse_plan(StagePlan((0, 2, 4), recompute=("none", "none")), "plan.json", SimpleNamespace(recompute="plan"))
    _refuse_plan(StagePlan((0, 2, 4)), "plan.json", SimpleNamespace(recompute="plan"))  # hand-written


@pytest.mark.parametrize(("flags", "line"), [
    ({"verify": True}, "--verify runs on the torch engine (--engine torch)"),
    ({"recompute": "selective"}, "--recompute selective|full runs on the torch engine"),
    ({"zero": "3"}, "--zero 3 on --engine deepspeed: DeepSpeed's pipeline engine runs ZeRO 0 or 1 only"),
    ({"schedule": "zbv"}, "--schedule zbv: DeepSpeed runs its own 1F1B schedule"),
])
def test_train_py_flags_deepspeed_does_not_run_are_refused(flags: dict, line: str):
    """train.py --engine deepspeed refuses what its engine does not run before anything starts (that
    such a refusal reaches the user as train.py's one line, exit 1, is test_zero's --zero 2 launch)."""
    from types import SimpleNamespace

    from autopipe.errors import AutopipeError
    from autopipe.runtime.deepspeed_engine.settings import refuse_flags

    with pytest.raises(AutopipeError) as info:
        refuse_flags(SimpleNamespace(**flags))
    assert str(info.value).startswith(line), str(info.value)
    refuse_flags(SimpleNamespace(verify=False, recompute="none", zero="1", schedule="gpipe"))  # all of these run


def test_report_keeps_a_report_html_it_did_not_write(factory: str):
    """`autopipe report PLAN` rebuilds its own report.html, but a report.html of the user's beside the plan needs --force."""
    assert _convert(factory, "--stages", "2").exit_code == 0
    job = Path("jobs/tiny-build")
    assert runner.invoke(app, ["report", str(job / "plan.json")]).exit_code == 0  # its own: rebuilt
    (job / "report.html").write_text("<html>my notes</html>")
    _fails_cleanly(runner.invoke(app, ["report", str(job / "plan.json")]), "is not an autopipe report")
    assert (job / "report.html").read_text() == "<html>my notes</html>"
    assert runner.invoke(app, ["report", str(job / "plan.json"), "--force"]).exit_code == 0


def test_a_factory_s_data_that_does_not_fit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Data the factory returns is checked against the model like --data: one line, nothing written."""
    (tmp_path / "fd.py").write_text(
        "import numpy as np, torch\nfrom torch import nn\n"
        "def build(batch_size=2):\n"
        "    return {'model': nn.Sequential(nn.Linear(4, 3)), 'args': (torch.zeros(batch_size, 4),),\n"
        "            'data': {'x': np.zeros((8, 5), np.float32), 'y': np.zeros(8, np.int64)}}\n")
    monkeypatch.chdir(tmp_path)
    _fails_cleanly(_convert("fd.py:build", "--stages", "1", "--loss", "cross_entropy"), "x has rows of shape (5,)")
    assert not Path("jobs").exists()


@pytest.mark.slow  # traces and estimates Llama-70B on the meta device
def test_a_plan_for_a_gpu_is_held_to_its_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Issue 10's case: Llama-70B estimated for 8 H100s used to plan 129-147 GiB stages without a word.
    The H100's memory is now the default limit: refused in one line saying what would fit. Run at
    Llama-2-13B's shape on 2 stages (~104 GiB a stage): the same refusal in a third of 70B's time (40 layers to trace, not 80)."""
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["convert", "llama-13b", "--stages", "2", "--estimate", "--device", "h100"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    (error,) = _error_lines(result.output)
    assert "fits the NVIDIA H100 80GB HBM3's 80.00 GiB (its memory, the default limit)" in error
    more = int(re.search(r"(\d+) stages would fit", error).group(1))
    assert more > 2 and "ZeRO-1" in error
    assert not Path("jobs").exists()


def test_python_dash_m_autopipe_is_the_same_cli(tmp_path: Path) -> None:
    """`python -m autopipe ...` (an image whose script folder is not on PATH, as the lent GPU's was):
    the same commands, and a bad model is still one line and exit 1."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "autopipe", *args], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=120)

    shown = run("--help")
    assert shown.returncode == 0 and "convert" in shown.stdout
    bad = run("inspect", "no-such-model-xyz")
    assert bad.returncode == 1 and len(_error_lines(bad.stdout + bad.stderr)) == 1, bad.stdout + bad.stderr


def test_a_factory_that_fixes_its_sequence_length_gets_a_job_of_that_width(tmp_path: Path) -> None:
    """tests/tp_models.py's Llama takes no seq_len and returns 16-token rows. convert without --seq-len
    (64) used to write a job whose first step failed on the traced shape ("input 'input_ids' has shape
    (2, 64) but the sequence was traced with (2, 16)"), on synthetic data and on --data windows alike.
    Now the job trains 16-token rows and convert says so; on a token file its first step equals the
    untouched model's (--verify)."""
    import subprocess
    import sys

    import numpy as np

    factory = f"{Path(__file__).resolve().parent / 'tp_models.py'}:llama"
    tokens = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 96, 2000, dtype=np.uint16).tofile(tokens)
    for job, flags in (("synthetic", ["--estimate"]), ("data", ["--data", str(tokens)])):
        result = runner.invoke(app, ["convert", factory, "--stages", "1", "--out", str(tmp_path / job), "--reserve", "0",
                                     *flags])  # (--reserve 0: no probe, test_reserve's)
        assert result.exit_code == 0, result.output
        assert "example inputs are 16 tokens a row, not --seq-len 64: the job trains rows of 16" in result.output
        assert read_settings(tmp_path / job / "train.py")["seq_len"] == 16
    ran = subprocess.run([sys.executable, str(tmp_path / "data" / "train.py"), "--steps", "1", "--verify"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    line = next((x for x in ran.stdout.splitlines() if x.startswith("verify:")), ran.stdout + ran.stderr)
    assert ran.returncode == 0 and line.endswith(": ok") and f"data {tokens}" in ran.stdout, line[-2000:]
