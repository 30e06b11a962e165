"""train.py from templates/train.py: a Python file filled in at two places (its Settings class and its
docstring's launch lines), each setting declared once (the flag's default is the field's), one table
of dtypes, engines and optimizers, a misspelled setting refused, both engines in the same visible
sections, lines a person reads on one screen, and a train.py written before the template moved
still finding every name it calls (that it trains, on both engines, is tests/test_legacy_job.py's)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest

import autopipe.job.script as script
import autopipe.runtime as rt
from autopipe.choices import ENGINES, PRECISIONS
from autopipe.errors import AutopipeError
from autopipe.job.script import read_settings, render_train_script, template_text, write_train_script
from autopipe.job.settings import JobSettings
from autopipe.runtime.process.flags import settings_parser

ROOT = Path(__file__).resolve().parents[1]
LEGACY = Path(__file__).parent / "fixtures" / "job_d5ffd7b"


def _settings_class(path: Path) -> type:
    """The Settings dataclass of a written train.py, run up to its class (nothing of the job runs)."""
    text = path.read_text()
    head = text[: text.index("cfg = rt.parse_flags(Settings)")]
    module = types.ModuleType("written_train")
    module.__file__ = str(path)
    sys.modules[module.__name__] = module  # dataclasses and typing read the class's module
    exec(compile(head, str(path), "exec", dont_inherit=True), module.__dict__)
    return module.Settings


def test_template_is_python_without_doubled_braces() -> None:
    """The template compiles as it is, holds no .format escapes, and its f-strings read as written."""
    text = template_text()
    compile(text, "train.py", "exec")
    assert "{{" not in text and "}}" not in text
    assert 'f"{cfg.model}: {len(build.seq.layers)} layers' in text


def test_each_setting_is_declared_once_and_read_under_one_screen_width() -> None:
    """No constant is repeated as a flag default: the script has no argparse of its own, one Settings
    field per setting, and no line over 100 columns."""
    text = template_text()
    assert "argparse" not in text and "add_argument" not in text
    tree = ast.parse(text)
    settings = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    names = [n.target.id for n in settings.body if isinstance(n, ast.AnnAssign)]
    assert len(names) == len(set(names)) > 30
    constants = [ast.unparse(n.targets[0]) for n in tree.body if isinstance(n, ast.Assign)]
    assert not [c for c in constants if c.isupper() and c != "HERE"], constants  # settings live in Settings
    wide = [(i, len(line)) for i, line in enumerate(text.splitlines(), 1) if len(line) > 100]
    assert not wide, wide


def test_written_script_is_the_template_but_settings_and_launch_lines(tmp_path: Path) -> None:
    """Settings become repr values (types and help kept), the docstring's launch lines get the job's
    process counts, and every other line is the template's, verbatim."""
    job = JobSettings(model="/models/my llama", stages=3, microbatches=6, schedule="gpipe", batch_size=2, seq_len=32,
                      dtype="bfloat16", engine="deepspeed", seed=5, loss="mse", data="/data/x.npz")  # fmt: skip
    path = write_train_script(tmp_path, job, dp=2, zero=1)
    text = path.read_text()
    expected = {"model": "/models/my llama", "schedule": "gpipe", "microbatches": 6, "batch_size": 2, "seq_len": 32,
                "dtype": "bf16", "engine": "deepspeed", "loss": "mse", "data": "/data/x.npz", "seed": 5, "dp": 2,
                "zero": 1}  # fmt: skip
    values = read_settings(path)
    assert {k: values[k] for k in expected} == expected
    assert "    microbatches: int = 6  # per step" in text
    assert "    dtype: Literal['fp32', 'bf16', 'fp16'] = 'bf16'  # autocast" in text
    doc = ast.get_docstring(ast.parse(text))
    assert doc.startswith("Pipeline-parallel training of /models/my llama, written by `autopipe convert`.")
    launches = [line.split("#")[0].strip() for line in doc.splitlines() if "train.py" in line and "#" in line]
    assert launches[:4] == ["torchrun --nproc-per-node 3 train.py",
                            "torchrun --nproc-per-node 6 train.py --dp 2 --zero 3",
                            "torchrun --nproc-per-node 3 train.py --engine deepspeed", "python train.py"]
    assert "$" not in text
    template, written = template_text().splitlines(), text.splitlines()
    assert len(written) == len(template)
    changed = [i for i, (a, b) in enumerate(zip(template, written)) if a != b]
    field_lines = [i for i, line in enumerate(template) if re.match(r"    [a-z_]+: ", line)]
    docstring_lines = [i for i, line in enumerate(template) if "$" in line]
    assert set(changed) <= set(field_lines) | set(docstring_lines)
    assert set(changed) >= set(docstring_lines)


def test_every_flag_defaults_to_its_setting_with_its_comment_as_help(tmp_path: Path) -> None:
    """The flags are the Settings fields: --name-with-dashes (and DeepSpeed's --name_with_underscores),
    the field's value as default, its Literal as choices, its comment (and the comment lines under
    it) as help; a switch for a bool, an optional value for --resume and --tensorboard."""
    path = write_train_script(tmp_path, JobSettings(model="gpt2", stages=2, microbatches=4, schedule="zbv"), zero=1)
    settings = _settings_class(path)
    parser = settings_parser(settings)
    args = parser.parse_args([])
    assert (args.microbatches, args.schedule, args.zero, args.betas, args.resume) == (4, "zbv", 1, (0.9, 0.95), None)
    args = parser.parse_args(["--batch-size", "3", "--deepspeed_config", "x.json", "--betas", "0.8,0.9", "--verify",
                              "--resume", "--tensorboard", "--lr-schedule", "linear"])  # fmt: skip
    assert (args.batch_size, args.deepspeed_config, args.betas, args.verify, args.resume) == \
        (3, "x.json", (0.8, 0.9), True, "must")
    assert args.tensorboard == str(tmp_path / "tensorboard") and args.lr_schedule == "linear"
    assert parser.parse_args(["--resume", "auto"]).resume == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp8"])
    shown = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "per step; the gradients are their mean (default: 4)" in shown.stdout
    assert "activation recompute per chunk: the plan's choice, or one mode for every chunk" in shown.stdout
    assert "--local_rank" not in shown.stdout and "{fp32,bf16,fp16}" in shown.stdout


def test_dtypes_engines_and_optimizers_come_from_the_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Literal field's choices are written from autopipe's tables: a new entry in a table reaches
    train.py's --help without touching the template."""
    monkeypatch.setattr(script, "ENGINES", (*ENGINES, "megatron"))
    path = write_train_script(tmp_path, JobSettings(model="gpt2", stages=2, microbatches=4, schedule="1f1b"))
    text = path.read_text()
    assert "    engine: Literal['torch', 'deepspeed', 'megatron'] = 'torch'" in text
    assert f"    dtype: Literal[{', '.join(map(repr, PRECISIONS))}] = 'fp32'" in text
    shown = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "{fp32,bf16,fp16}" in shown.stdout and "{torch,deepspeed,megatron}" in shown.stdout


def test_a_misspelled_setting_is_refused(tmp_path: Path) -> None:
    """An unknown setting is an error naming the setting meant, not silently dropped; a value the job
    cannot run is refused before train.py is written."""
    base = dict(model="gpt2", stages=2, microbatches=4, schedule="1f1b")
    with pytest.raises(AutopipeError, match="unknown train.py setting 'sed'; did you mean 'seed'"):
        JobSettings.from_options(sed=3, **base)
    with pytest.raises(AutopipeError, match="engine must be one of 'torch', 'deepspeed'"):
        write_train_script(tmp_path, JobSettings(engine="megatron", **base))
    with pytest.raises(AutopipeError, match="unknown dtype 'fp8'"):
        write_train_script(tmp_path, JobSettings(dtype="fp8", **base))
    with pytest.raises(AutopipeError, match="unknown schedule 'nope'"):
        write_train_script(tmp_path, JobSettings(**{**base, "schedule": "nope"}))
    assert not (tmp_path / "train.py").exists()


def test_render_refuses_a_setting_the_template_lacks() -> None:
    """A setting the class does not hold is a bug caught when writing, not a silent omission."""
    launch = {"model": "gpt2", "stages": 2, "stages_x2": 4}
    with pytest.raises(AutopipeError, match="Settings has no nope"):
        render_train_script({"model": "gpt2", "nope": 1}, launch)
    with pytest.raises(KeyError):
        render_train_script({"model": "gpt2"}, {"model": "gpt2"})  # a launch placeholder left unfilled


def test_both_engines_run_the_same_sections() -> None:
    """DeepSpeed is chosen in one visible branch; data, resume, the loop, checkpoints and export are
    shared lines, the loop names where forward/backward, clip and step happen, and every rt name the
    script calls exists."""
    text = template_text()
    tree = ast.parse(text)
    branch = next(n for n in tree.body if isinstance(n, ast.If) and "deepspeed" in ast.unparse(n.test))
    assert "rt.DeepSpeedTrainer" in ast.unparse(branch.body) and "rt.Trainer" in ast.unparse(branch.orelse)
    after = text[text.index("# ---- data"):]
    code = "\n".join(line.split("#")[0] for line in after.splitlines())
    assert "engine" not in code.replace("{cfg.engine}", "")  # nothing below the branch but its name in a line
    for line in ("stats = trainer.step(batch_args, batch_kwargs, target)", "save_checkpoint(trainer, cfg.ckpt_dir",
                 "resume(trainer, cfg.ckpt_dir", "rt.export_final(trainer, cfg.export",
                 "rt.Evaluator(trainer, eval_data", "env.close()"):
        assert line in after, line
    loop = after[after.index("# ---- train"):]
    assert all(name in loop for name in ("forward_backward", "clip_gradients", "optimizer_step", "train_batch"))
    assert all(callable(getattr(rt.Trainer, name)) for name in ("forward_backward", "clip_gradients", "optimizer_step"))
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "rt"}
    assert {"DeepSpeedTrainer", "ds_save_checkpoint", "ds_resume", "export_final", "Evaluator", "flag"} <= used
    for name in used:
        assert getattr(rt, name) is not None, name


def test_every_name_an_old_train_py_calls_still_exists() -> None:
    """The train.py of a job written before the move (tests/fixtures/job_d5ffd7b) imports only names
    the runtime still has, train_deepspeed included."""
    tree = ast.parse((LEGACY / "train.py").read_text())
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "rt"}
    assert "train_deepspeed" in used and len(used) > 15
    for name in used:
        assert callable(getattr(rt, name)), name


def test_the_wheel_ships_the_template(tmp_path: Path) -> None:
    """setuptools puts templates/train.py into the wheel (it is package data, not a module)."""
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info there
    shutil.copytree(ROOT / "autopipe", src / "autopipe", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (wheel,) = (tmp_path / "dist").glob("autopipe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "autopipe/job/templates/train.py" in names and "autopipe/job/script.py" in names
