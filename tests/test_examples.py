"""examples/: each one runs as a user runs it (a subprocess, on CPU) and prints what it promises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopipe.cli import app
from autopipe.job.script import read_settings

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path = ROOT) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_alexnet_example_splits_without_a_lambda_layer():
    """The CNN flattens (torch.flatten included), is cut by cost, and 2 stages give its loss and gradients."""
    out = _run("examples/alexnet.py")
    assert "19 layers" in out
    assert "2 stages reproduce the model" in out and "gradients of 16 tensors equal" in out


@pytest.mark.slow
def test_transformer_mask_example_carries_the_mask_across_cuts():
    """Blocks taking (hidden, mask) need no wrappers: the mask crosses every cut and 3 stages match."""
    out = _run("examples/transformer_mask.py")
    cut_lines = [line for line in out.splitlines() if line.strip().startswith("after ")]
    assert len(cut_lines) == 2 and all("mask:bool[4,32]" in line for line in cut_lines)
    assert "3 stages reproduce the model" in out


@pytest.mark.slow
def test_my_model_example_runs_as_a_script():
    """The factory example's own script flattens, cuts in 2 and checks the loss."""
    out = _run("examples/my_model.py")
    assert "8 layers: embed, blocks.0" in out and "two stages give the model's loss" in out


def test_my_model_factory_converts(tmp_path: Path):
    """`autopipe convert examples/my_model.py:build --stages 2` makes a 2-stage job of its 8 layers, under
    the schedule it chose (one chunk per stage, or two under interleaved1f1b and zbv), which train.py runs."""
    result = CliRunner().invoke(app, ["convert", str(ROOT / "examples/my_model.py") + ":build", "--stages", "2",
                                      "--out", str(tmp_path / "job"), "--repeats", "1"])
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "job/plan.json").read_text())
    assert plan["num_layers"] == 8 and plan["stages"] == 2
    assert len(plan["boundaries"]) == 2 * plan["virtual_stages"] + 1 and plan["schedule_policy"] == "auto"
    assert read_settings(tmp_path / "job/train.py")["schedule"] == plan["schedule"]
    assert f"schedule {plan['schedule']}: predicted whole step" in result.output
    assert f"torchrun --nproc-per-node 2 {tmp_path / 'job'}/train.py" in result.output


@pytest.mark.slow
@pytest.mark.distributed
def test_gpt2_example_trains_with_falling_loss(tmp_path: Path):
    """Small GPT-2 end to end: convert, launch the printed command for 6 steps, the loss falls."""
    out = _run("examples/gpt2.py", "--workdir", str(tmp_path), "--steps", "6")
    assert "2 stages, cuts before layers" in out
    losses = [float(x) for x in next(l for l in out.splitlines() if l.startswith("losses:")).split()[1:]]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "loss fell" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_digits_cnn_learns_real_images_pipelined(tmp_path: Path):
    """A CNN trained on 2 processes on scikit-learn's digits (the factory's data, --loss cross_entropy)
    classifies held-out images far above chance (10%); the job's own evaluation (--eval-data) says the
    same accuracy as the plain model with the exported weights."""
    out = _run("examples/digits_cnn.py", "--workdir", str(tmp_path), "--steps", "80")
    line = next(l for l in out.splitlines() if l.startswith("held-out accuracy:"))
    accuracy = float(line.split()[2].rstrip("%")) / 100
    assert accuracy > 0.8, line
    assert line.endswith(f"the job's last evaluation: {line.split()[2]})"), line
    assert next(l for l in out.splitlines() if l.startswith("the job's evaluations:")).count("accuracy") == 2


@pytest.mark.slow
@pytest.mark.distributed
def test_masked_lm_and_seq2seq_learn_local_text(tmp_path: Path):
    """BERT (masked LM) and T5 (seq2seq) train on local text through their folder's tokenizer: the loss falls."""
    for task in ("mlm", "seq2seq"):
        out = _run("examples/text_lm.py", "--task", task, "--workdir", str(tmp_path / task), "--steps", "12")
        assert f"data {tmp_path / task / 'corpus.txt'}" in out and "loss fell" in out, out[-2000:]
        perplexities = next(l for l in out.splitlines() if l.startswith("held-out perplexity:"))
        assert perplexities.count(" at step ") == 2, perplexities  # evaluated at step 6 and at the end
