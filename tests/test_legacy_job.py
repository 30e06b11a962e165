"""A job folder people already have keeps training after an upgrade, and trains the model it names.

tests/fixtures/job_d5ffd7b/ was written by ``autopipe convert llama-tiny --stages 2 --seq-len 16
--microbatches 2`` before the package moved into pass folders (its README). Its train.py names
``autopipe.runtime`` as it was then; on DeepSpeed it makes one ``rt.train_deepspeed`` call where
today's spells the trainer out. Copied to a temporary folder, it trains 2 steps on 2 processes on
either engine, and its losses, gradient norms and exported weights equal the untouched model's
trained with the old script's settings (1e-5). (Today's train.py against the untouched model is
every other job test's; the one-process run of a job is test_zoo's.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _launch import Launcher

from autopipe.runtime import JobData, TrainConfig, build_reference, model_factory
from autopipe.runtime.checks.reference import ReferenceTrainer

pytestmark = [pytest.mark.slow, pytest.mark.distributed]  # each test trains the job on 2 processes

LEGACY = Path(__file__).parent / "fixtures" / "job_d5ffd7b"
STEPS, TOL = 2, 1e-5
MODEL, MICRO, ROWS, SEQ = "llama-tiny", 2, 1, 16  # the old train.py's MODEL, MICROBATCHES, BATCH_SIZE, SEQ_LEN

_REF: dict[str, tuple[list[float], list[float], dict[str, torch.Tensor]]] = {}


def _reference() -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """(losses, gradient norms, final weights by every name) of the untouched model trained as the old
    train.py trains it by default: seed 0, AdamW at --lr 3e-4, clip 1.0, its synthetic tokens."""
    if not _REF:
        source = model_factory(MODEL, batch_size=ROWS, seq_len=SEQ)
        model = build_reference(source.factory, seed=0)
        trainer = ReferenceTrainer(model, TrainConfig(steps=STEPS, microbatches=MICRO, lr=3e-4))
        data = JobData(source, None, seq_len=SEQ, seed=0)
        losses, norms = [], []
        for step in range(STEPS):
            losses.append(trainer.step(*data.batch(step, ROWS * MICRO)[:2], microbatches=MICRO))
            norms.append(trainer.last_grad_norm)
        weights = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        _REF["value"] = (losses, norms, weights)
    return _REF["value"]


@pytest.mark.parametrize("engine", ["torch", pytest.param("deepspeed", marks=pytest.mark.deepspeed)])
def test_a_job_written_before_the_move_trains_as_the_untouched_model(torchrun: Launcher, tmp_path: Path,
                                                                     engine: str) -> None:
    """2 processes, the old folder as it was: per-step losses, gradient norms and the weights it
    exports equal the untouched model's."""
    from safetensors.torch import load_file

    job = tmp_path / "legacy"
    shutil.copytree(LEGACY, job)
    torchrun(job / "train.py", "--steps", STEPS, "--engine", engine, "--log-json", job / "log.json",
             "--export", job / "exported", nproc=2, cwd=job)
    log = [json.loads(line) for line in (job / "log.json").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, STEPS + 1))
    losses, norms, weights = _reference()
    assert [r["loss"] for r in log] == pytest.approx(losses, abs=TOL)
    assert [r["grad_norm"] for r in log] == pytest.approx(norms, rel=TOL)
    exported = load_file(job / "exported" / "model.safetensors")
    assert set(exported) == set(weights) and len(exported) > 10
    for name, value in exported.items():
        torch.testing.assert_close(value, weights[name], atol=TOL, rtol=0, msg=name)
