"""train.py from templates/train.py: a Python file filled in at two places (its settings block and its
docstring's launch lines), one table of dtypes and engines, a misspelled setting refused, both
engines in the same visible sections, and a train.py written before the template moved still finding
every name it calls (that it trains, on both engines, is tests/test_legacy_job.py's)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import autopipe.job.script as script
import autopipe.runtime as rt
from autopipe.choices import ENGINES, PRECISIONS
from autopipe.errors import AutopipeError
from autopipe.job.script import render_train_script, template_text, write_train_script

ROOT = Path(__file__).resolve().parents[1]
LEGACY = Path(__file__).parent / "fixtures" / "job_d5ffd7b"


def _assignments(text: str) -> dict[str, object]:
    """Module-level NAME = <literal> assignments of a script."""
    found = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                found[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return found


def test_template_is_python_without_doubled_braces() -> None:
    """The template compiles as it is, holds no .format escapes, and its f-strings read as written."""
    text = template_text()
    compile(text, "train.py", "exec")
    assert "{{" not in text and "}}" not in text
    assert 'f"{MODEL}: {len(build.seq.layers)} layers' in text


def test_written_script_is_the_template_but_settings_and_launch_lines(tmp_path: Path) -> None:
    """Settings become repr lines (comments kept), the docstring's launch lines get the job's process
    counts, and every other line is the template's, verbatim."""
    path = write_train_script(tmp_path, model="/models/my llama", stages=3, microbatches=6, schedule="gpipe",
                              batch_size=2, seq_len=32, dtype="bfloat16", engine="deepspeed", seed=5, loss="mse",
                              data="/data/x.npz", dp=2, zero=1)  # fmt: skip
    text = path.read_text()
    values = _assignments(text)
    expected = {"MODEL": "/models/my llama", "SCHEDULE": "gpipe", "MICROBATCHES": 6, "BATCH_SIZE": 2, "SEQ_LEN": 32,
                "DTYPE": "bf16", "ENGINE": "deepspeed", "LOSS": "mse", "DATA": "/data/x.npz", "SEED": 5, "DP": 2,
                "ZERO": 1, "DTYPES": tuple(PRECISIONS), "ENGINES": tuple(ENGINES)}  # fmt: skip
    assert {k: values[k] for k in expected} == expected
    assert "MICROBATCHES = 6\n" in text and "DTYPE = 'bf16'  # training precision" in text
    doc = ast.get_docstring(ast.parse(text))
    assert doc.startswith("Pipeline-parallel training of /models/my llama, written by autopipe.")
    launches = [line.split("#")[0].strip() for line in doc.splitlines() if "train.py" in line and "#" in line]
    assert launches[:5] == ["autopipe run train.py", "torchrun --nproc-per-node 3 train.py",
                            "torchrun --nproc-per-node 6 train.py --dp 2",
                            "torchrun --nproc-per-node 6 train.py --dp 2 --zero 3",
                            "torchrun --nproc-per-node 3 train.py --engine deepspeed"]  # the README's command
    assert "deepspeed --num_gpus" not in text and "$" not in text
    template = template_text().splitlines()
    written = text.splitlines()
    assert len(written) == len(template)
    changed = [i for i, (a, b) in enumerate(zip(template, written)) if a != b]
    settings_lines = [i for i, line in enumerate(template) if line.split(" = ")[0] in expected]
    docstring_lines = [i for i, line in enumerate(template) if "$" in line]
    assert set(changed) <= set(settings_lines) | set(docstring_lines)
    assert set(changed) >= set(docstring_lines)


def test_dtypes_and_engines_come_from_the_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """argparse's choices are the script's DTYPES / ENGINES, written from autopipe.choices: a new
    entry in a table reaches train.py's --help without touching the template."""
    text = template_text()
    assert "choices=DTYPES" in text and "choices=ENGINES" in text
    assert '"bf16"' not in text and '["torch", "deepspeed"]' not in text
    monkeypatch.setattr(script, "ENGINES", (*ENGINES, "megatron"))
    path = write_train_script(tmp_path, model="gpt2", stages=2, microbatches=4, schedule="1f1b", engine="megatron")
    assert _assignments(path.read_text())["ENGINES"] == ("torch", "deepspeed", "megatron")
    shown = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert "{fp32,bf16,fp16}" in shown.stdout and "{torch,deepspeed,megatron}" in shown.stdout


def test_a_misspelled_setting_is_refused(tmp_path: Path) -> None:
    """An unknown keyword is an error naming the setting meant, not silently dropped (device included:
    where the job was profiled is not a train.py setting)."""
    base = dict(model="gpt2", stages=2, microbatches=4, schedule="1f1b")
    with pytest.raises(AutopipeError, match="unknown train.py setting 'sed'; did you mean 'seed'"):
        write_train_script(tmp_path, sed=3, **base)
    with pytest.raises(AutopipeError, match="unknown train.py setting 'device'"):
        write_train_script(tmp_path, device="cpu", **base)
    with pytest.raises(AutopipeError, match="engine must be one of 'torch', 'deepspeed'"):
        write_train_script(tmp_path, engine="megatron", **base)
    with pytest.raises(AutopipeError, match="unknown dtype 'fp8'"):
        write_train_script(tmp_path, dtype="fp8", **base)
    assert not (tmp_path / "train.py").exists()


def test_render_refuses_a_setting_the_template_lacks() -> None:
    """A settings name the block does not hold is a bug caught when writing, not a silent omission."""
    launch = {"model": "gpt2", "stages": 2, "stages_x2": 4}
    with pytest.raises(AutopipeError, match="settings block has no NOPE"):
        render_train_script({"MODEL": "gpt2", "NOPE": 1}, launch)
    with pytest.raises(KeyError):
        render_train_script({"MODEL": "gpt2"}, {"model": "gpt2"})  # a launch placeholder left unfilled


def test_both_engines_run_the_same_sections() -> None:
    """DeepSpeed is chosen in one visible branch; data, resume, the loop, checkpoints and export are
    shared lines, and every rt name the script calls exists."""
    text = template_text()
    tree = ast.parse(text)
    branch = next(n for n in tree.body if isinstance(n, ast.If) and "deepspeed" in ast.unparse(n.test))
    assert "rt.DeepSpeedTrainer" in ast.unparse(branch.body) and "rt.Trainer" in ast.unparse(branch.orelse)
    after = text[text.index("# ---- data"):]
    assert "engine" not in after.replace("on {args.engine}", "")  # nothing below the branch depends on the engine
    for line in ("stats = trainer.step(batch_args, batch_kwargs, target)", "save_checkpoint(trainer, args.ckpt_dir",
                 "resume(trainer, args.ckpt_dir", "rt.export_final(trainer, args.export",
                 "rt.Evaluator(trainer, eval_data", "env.close()"):
        assert line in after, line
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "rt"}
    assert {"DeepSpeedTrainer", "ds_save_checkpoint", "ds_resume", "export_final", "Evaluator"} <= used
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
