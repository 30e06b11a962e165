"""Evaluation inside the job: forward-only through the pipeline, equal to the untouched model.

``--eval-data`` is read in order; every ``--eval-every`` steps and at the end the pipeline runs
its batches forward only, in eval mode. The reference is the model as its factory builds it, at
the job's weights (initial ones for ``--steps 0``, the exported final ones after training), in eval
mode, on the same rows: the mean micro-batch loss within 1e-5, perplexity its exponential, accuracy
the same count of rows. Evaluating must not change training: with dropout on, the losses of a run
that evaluates every step equal the untouched model's trained with the same dropout draws (eval mode
is undone, FSDP2's gathered weights are freed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _factories import tiny_gpt2_job
from _launch import Launcher

from autopipe.graph.flattener import flatten
from autopipe.job.script import write_train_script
from autopipe.job.settings import JobSettings
from autopipe.runtime import (
    JobData,
    ReferenceTrainer,
    TrainConfig,
    build_reference,
    model_factory,
)
from autopipe.runtime.checks.untouched import untouched_model
from autopipe.runtime.data.batches import split_batch
from autopipe.runtime.data.losses import make_loss, model_outputs_logits
from autopipe.runtime.stage.build import meta_model

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # every test starts train.py on several processes

MICRO, ROWS, SEQ = 2, 2, 16
TOL = 1e-5

CNN = '''
import torch
from torch import nn


def build(batch_size=2):
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
    return model, (torch.randn(batch_size, 1, 8, 8),)
'''


def _dropout_job(folder: Path) -> Path:
    """A GPT-2 with dropout 0.1 and its train.py: a run's losses depend on each layer's train mode."""
    from transformers import GPT2Config

    GPT2Config(architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=SEQ,
               resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0).save_pretrained(folder / "m")
    return write_train_script(folder / "train.py", JobSettings(model=str(folder / "m"), stages=2, microbatches=MICRO, schedule="1f1b", batch_size=ROWS, seq_len=SEQ))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 job (no dropout), its held-out tokens, a CNN job and its held-out images."""
    root = tmp_path_factory.mktemp("eval")
    tiny_gpt2_job(root, layers=2, microbatches=MICRO, rows=ROWS, seq=SEQ)
    rng = np.random.default_rng(0)
    rng.integers(0, 128, 200, dtype=np.uint16).tofile(root / "val.bin")  # 12 windows: 3 batches of 4 rows
    (root / "cnn.py").write_text(CNN)
    x = rng.standard_normal((40, 1, 8, 8)).astype(np.float32)
    np.savez(root / "images.npz", x=x, y=rng.integers(0, 10, 40))
    (root / "cnn").mkdir()
    write_train_script(root / "cnn" / "train.py", JobSettings(model=f"{root / 'cnn.py'}:build", stages=2, microbatches=MICRO, schedule="1f1b", batch_size=ROWS, loss="cross_entropy"))
    return root


def _trained_with_dropout(folder: Path, steps: int) -> tuple[list[float], list[float]]:
    """(losses, gradient norms) of the untouched dropout GPT-2 of ``_dropout_job(folder)`` trained as
    ``_train`` trains the job (train.py's defaults, --lr 1e-2, its synthetic tokens), its dropout drawn
    where each layer starts as the pipeline seeds that layer."""
    source = model_factory(str(folder / "m"), batch_size=ROWS, seq_len=SEQ)
    entries = flatten(meta_model(source.factory), source.args, source.kwargs, device_type="cpu").layer_entries
    trainer = ReferenceTrainer(untouched_model(source.factory, seed=0), TrainConfig(steps=steps, microbatches=MICRO, lr=1e-2),
                               loss_fn=make_loss(source.loss), layer_entries=entries)
    data = JobData(source, None, seq_len=SEQ, seed=0)
    losses, norms = [], []
    for step in range(steps):
        losses.append(trainer.step(*data.batch(step, ROWS * MICRO)))
        norms.append(trainer.last_grad_norm)
    return losses, norms


def _train(torchrun: Launcher, script: Path, *flags: object, nproc: int = 2) -> list[dict]:
    log = script.parent / f"log-{abs(hash(flags))}.json"
    log.unlink(missing_ok=True)
    torchrun(script, "--plan", "even", "--lr", "1e-2", "--log-json", log, *flags, nproc=nproc, cwd=script.parent)
    return [json.loads(line) for line in log.read_text().splitlines()]


def _reference(model: torch.nn.Module, source, data_path: Path, loss: str | None = None) -> dict[str, float]:  # noqa: ANN001
    """The untouched model in eval mode on the evaluation's batches, micro-batch by micro-batch."""
    from autopipe.runtime import build_stage

    seq = build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq  # its outputs' shapes
    data = JobData(source, str(data_path), seq_len=SEQ, shuffle=False, seq=seq)
    rows = ROWS * MICRO
    loss_fn = make_loss(loss) if loss else None
    model.eval()
    losses, correct, labelled = [], 0, 0
    with torch.no_grad():
        for k in range(data.size // rows):
            args, kwargs, target = data.batch(k, rows)
            labels = data.class_labels(k, rows)
            targets = list(target.chunk(MICRO)) if target is not None else [None] * MICRO
            for (a, kw), t in zip(split_batch(args, kwargs, MICRO), targets):
                out = model(*a, **kw)
                losses.append(float(out.loss if loss_fn is None else loss_fn(out, t)))
            if labels is not None:
                logits = torch.cat([model_outputs_logits(model(*a, **kw)) for a, kw in split_batch(args, kwargs, MICRO)])
                correct += int((logits.argmax(-1) == labels).sum())
                labelled += labels.numel()
    mean = sum(losses) / len(losses)
    return {"eval_loss": mean, "eval_perplexity": math.exp(mean), "accuracy": correct / labelled if labelled else None}


def test_eval_loss_and_perplexity_equal_the_untouched_model_s(torchrun: Launcher, root: Path) -> None:
    """GPT-2, 2 stages, 2 steps evaluating after each: the last evaluation's loss and perplexity equal
    the untouched model's at the exported weights (loaded with HF's from_pretrained), which trained
    away from the initial ones. (An evaluation with no step, --steps 0, is the classifier's test.)"""
    from transformers import GPT2LMHeadModel

    source = model_factory(str(root / "tiny"), batch_size=ROWS, seq_len=SEQ)
    log = _train(torchrun, root / "train.py", "--steps", "2", "--eval-data", root / "val.bin", "--eval-every", "1",
                 "--export", root / "exported")
    assert [r["step"] for r in log] == [1, 2] and all("eval_loss" in r for r in log)
    assert all("eval_accuracy" not in r for r in log)  # a language model: perplexity, no accuracy
    expected = _reference(GPT2LMHeadModel.from_pretrained(root / "exported"), source, root / "val.bin")
    assert log[-1]["eval_loss"] == pytest.approx(expected["eval_loss"], abs=TOL)
    assert log[-1]["eval_perplexity"] == pytest.approx(expected["eval_perplexity"], rel=TOL)
    start = _reference(build_reference(source.factory, seed=0), source, root / "val.bin")
    assert log[-1]["eval_loss"] != pytest.approx(start["eval_loss"], abs=1e-3)  # it trained


def test_eval_accuracy_of_a_classifier_equals_the_untouched_model_s(torchrun: Launcher, root: Path) -> None:
    """A CNN trained with --loss cross_entropy, --steps 0 (one evaluation, at the end, with no step):
    eval loss and the share of rows whose argmax is the label at the initial weights."""
    source = model_factory(f"{root / 'cnn.py'}:build", batch_size=ROWS, seq_len=SEQ, loss="cross_entropy")
    (start,) = _train(torchrun, root / "cnn" / "train.py", "--steps", "0", "--eval-data", root / "images.npz")
    expected = _reference(build_reference(source.factory, seed=0), source, root / "images.npz", loss="cross_entropy")
    assert start["step"] == 0 and "loss" not in start  # an evaluation with no step
    assert start["eval_loss"] == pytest.approx(expected["eval_loss"], abs=TOL)
    assert start["eval_accuracy"] == pytest.approx(expected["accuracy"], abs=1e-12)
    assert "eval_perplexity" not in start


def test_evaluating_does_not_change_training_dropout_on(torchrun: Launcher, root: Path, tmp_path: Path) -> None:
    """GPT-2 with dropout 0.1: 3 steps evaluating after each train as the untouched model does with the
    same dropout draws (eval mode is undone; the training RNG is the step's own), and the evaluation
    has dropout off: it equals the exported model's in eval mode (the traced layers hold dropout's
    flags as constants, which .eval() alone left on)."""
    from transformers import GPT2LMHeadModel

    script = _dropout_job(tmp_path)
    evaluating = _train(torchrun, script, "--steps", "3", "--eval-data", root / "val.bin", "--eval-every", "1",
                        "--export", tmp_path / "exported")
    losses, norms = _trained_with_dropout(tmp_path, 3)
    assert [r["loss"] for r in evaluating] == pytest.approx(losses, abs=TOL)
    assert [r["grad_norm"] for r in evaluating] == pytest.approx(norms, rel=TOL)
    assert all("eval_loss" in r for r in evaluating)
    source = model_factory(str(tmp_path / "m"), batch_size=ROWS, seq_len=SEQ)
    trained = GPT2LMHeadModel.from_pretrained(tmp_path / "exported")
    assert trained.config.attn_pdrop == 0.1  # the reference has dropout too, off in eval mode
    assert evaluating[-1]["eval_loss"] == pytest.approx(_reference(trained, source, root / "val.bin")["eval_loss"],
                                                        abs=TOL)


def test_eval_under_zero_2_replicas_equals_the_untouched_model_and_leaves_training_alone(torchrun: Launcher,
                                                                                          root: Path) -> None:
    """dp 2 x pp 2 on FSDP2 (ZeRO 2, which keeps a forward's gathered weights for its backward): each
    replica evaluates its own rows; the evaluation equals the untouched model at the exported weights
    and training equals the untouched model trained on the global batch."""
    from transformers import GPT2LMHeadModel

    flags = ["--steps", "2", "--dp", "2", "--zero", "2", "--microbatches", str(MICRO)]
    log = _train(torchrun, root / "train.py", *flags, "--eval-data", root / "val.bin", "--eval-every", "1",
                 "--export", root / "exported-z2", nproc=4)
    assert len(log) == 2 and all("eval_loss" in r for r in log)
    source = model_factory(str(root / "tiny"), batch_size=ROWS, seq_len=SEQ)
    # training left alone: its losses are the untouched model's trained on the global batch (step 2's
    # loss is after step 1's evaluation), without a second 4-process launch that skips the evaluation
    rows = ROWS * MICRO * 2
    trainer = ReferenceTrainer(build_reference(source.factory, seed=0), TrainConfig(steps=2, microbatches=MICRO * 2, lr=1e-2))
    steps = JobData(source, None, seq_len=SEQ)
    assert [r["loss"] for r in log] == pytest.approx(
        [trainer.step(*steps.batch(k, rows)[:2], microbatches=MICRO * 2) for k in range(2)], abs=TOL)
    trained = GPT2LMHeadModel.from_pretrained(root / "exported-z2")
    data = JobData(source, str(root / "val.bin"), seq_len=SEQ, shuffle=False)
    rows = ROWS * MICRO * 2  # the global batch: each replica evaluates half
    losses = []
    trained.eval()
    with torch.no_grad():
        for k in range(data.size // rows):
            for replica in (0, 1):
                args, kwargs, _ = data.batch(k, rows, replica=replica, replicas=2)
                losses += [float(trained(*a, **kw).loss) for a, kw in split_batch(args, kwargs, MICRO)]
    assert log[-1]["eval_loss"] == pytest.approx(sum(losses) / len(losses), abs=TOL)


@pytest.mark.deepspeed
def test_eval_on_deepspeed_equals_the_untouched_model_and_leaves_training_alone(torchrun: Launcher, root: Path,
                                                                                tmp_path: Path) -> None:
    """--engine deepspeed: eval_batch through its PipelineEngine, the same figures; its module back in
    train mode after (DeepSpeed's eval_batch leaves it in eval mode: with dropout on, the losses of
    the step after an evaluation say so against the untouched model's with the same draws)."""
    script = _dropout_job(tmp_path)
    log = _train(torchrun, script, "--engine", "deepspeed", "--steps", "2", "--eval-data", root / "val.bin",
                 "--eval-every", "1", "--export", tmp_path / "exported")
    losses, norms = _trained_with_dropout(tmp_path, 2)
    assert [r["loss"] for r in log] == pytest.approx(losses, abs=TOL) and all("eval_loss" in r for r in log)
    assert [r["grad_norm"] for r in log] == pytest.approx(norms, rel=TOL)
    from transformers import GPT2LMHeadModel

    dropout_source = model_factory(str(tmp_path / "m"), batch_size=ROWS, seq_len=SEQ)
    trained = GPT2LMHeadModel.from_pretrained(tmp_path / "exported")  # dropout 0.1, off in eval mode
    assert log[-1]["eval_loss"] == pytest.approx(_reference(trained, dropout_source, root / "val.bin")["eval_loss"],
                                                 abs=TOL)
