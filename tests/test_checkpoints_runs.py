"""A run never loses its checkpoints, and a checkpoint holds each weight once.

Before: with step_195/step_200 of an earlier run in checkpoints/, a 3-step run with --ckpt-keep 2
rotated its own step_3 away and exited 0; --export then wrote the old run's weights and --resume
continued the old run. A checkpoint held the weights twice (sharded, and replica 0's rank files).
Now a run saving into a folder of another run's checkpoints is refused in one line, before it
trains; --export writes the weights the run ends with; rotation keeps the newest; after a resume
the step log (and TensorBoard) has each step once; rank files are kilobytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _factories import tiny_gpt2_job
from _launch import Launcher

from autopipe.runtime import (
    JobData,
    TrainConfig,
    Trainer,
    build_reference,
    build_stage,
    init_dist,
    make_loss,
    model_factory,
)
from autopipe.runtime.checkpoints.exports import checkpoint_params, export
from autopipe.runtime.checkpoints.folders import CheckpointFolderError, check_ckpt_dir, claim_ckpt_dir
from autopipe.runtime.checkpoints.store import save_checkpoint
from autopipe.runtime.checks.reference import ReferenceTrainer

MICRO, ROWS, SEQ = 2, 2, 16


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 512), torch.nn.Tanh(), torch.nn.Linear(512, 1))


def _trainer() -> Trainer:
    x = torch.randn(8, 8)
    env = init_dist(dp=1)
    build = build_stage(_net, (x[:2],), {}, [0, 2, 3], pp_rank=env.pp_rank, pp_size=env.pp_size)
    return Trainer(build, env, TrainConfig(steps=10, microbatches=4), loss_fn=make_loss("mse"))


def test_a_save_never_removes_the_newest_and_refuses_another_run_s_folder(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """In one process: a folder with another run's checkpoints is refused by save_checkpoint itself
    (what an older train.py calls), nothing written; a folder resumed from is this run's; --ckpt-keep 1
    keeps exactly the checkpoint just written, also when an older run's is numbered higher."""
    import autopipe.runtime.checkpoints.folders as checkpoint

    trainer = _trainer()
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    try:
        old = tmp_path / "old"
        for _ in range(2):
            trainer.step((x,), {}, y)
            save_checkpoint(trainer, old, keep=0)
        assert [p.name for p in sorted(old.glob("step_*"))] == ["step_00000001", "step_00000002"]

        monkeypatch.setattr(checkpoint, "_CLAIMED", set())  # a new run: a process of its own knows no folder
        trainer.step((x,), {}, y)
        with pytest.raises(CheckpointFolderError, match=r"holds another run's checkpoints \(steps 1-2 \(2 checkpoints\)\); "
                                                        r"nothing was written. Continue that run with --resume"):
            save_checkpoint(trainer, old, keep=2)
        assert [p.name for p in sorted(old.iterdir())] == ["step_00000001", "step_00000002"]
        with pytest.raises(CheckpointFolderError):
            check_ckpt_dir(old, resume=None, saving=True)
        check_ckpt_dir(old, resume=None, saving=False)  # a run that saves nothing touches nothing
        check_ckpt_dir(old, resume="must", saving=True)

        claim_ckpt_dir(old)  # what --resume does
        trainer.step_count = 5
        saved = save_checkpoint(trainer, old, keep=1)
        assert sorted(p.name for p in old.iterdir()) == ["step_00000005"] and saved == old / "step_00000005"
        trainer.step_count = 3  # the run just written is never rotated away, whatever else is there
        saved = save_checkpoint(trainer, old, keep=1)
        assert sorted(p.name for p in old.iterdir()) == ["step_00000003", "step_00000005"]
    finally:
        trainer.env.close()


def test_a_checkpoint_stores_each_weight_once_and_exports_them(tmp_path: Path) -> None:
    """Rank files hold the step, schedule and RNG (kilobytes, no weights); sharded/ holds the weights and
    AdamW's two moments once: its bytes are 3x the parameter bytes plus a little metadata. export reads
    them back equal to the trainer's."""
    trainer = _trainer()
    try:
        trainer.step((torch.randn(8, 8),), {}, torch.randn(8, 1))
        ckpt = save_checkpoint(trainer, tmp_path / "ckpt")
        params = {n: p.detach().clone() for n, p in trainer.params.items()}
    finally:
        trainer.env.close()
    weights = sum(p.numel() * p.element_size() for p in params.values())
    sharded = sum(f.stat().st_size for f in (ckpt / "sharded").rglob("*") if f.is_file() and f.suffix == ".distcp")
    # each of the 4 tensors and its 3 optimizer entries (2 moments, a step count) costs DCP ~1.7 KB of framing
    assert 3 * weights <= sharded <= 3 * weights + 16 * 2048, (weights, sharded)
    assert all(f.stat().st_size < 16_384 for f in ckpt.glob("rank*.pt"))
    assert "params" not in torch.load(ckpt / "rank00000.pt", weights_only=False)
    back = checkpoint_params(ckpt)
    assert set(back) == set(params)
    for n, v in back.items():
        assert torch.equal(v, params[n]), n
    from safetensors.torch import load_file

    exported = load_file(export(ckpt, tmp_path / "out"))
    assert all(torch.equal(exported[n], params[n]) for n in params)


# ---- real runs: a tiny GPT-2 (tied wte/lm_head) on 2 stages -----------------------------------------

@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    tiny_gpt2_job(root, layers=2, microbatches=MICRO, rows=ROWS, seq=SEQ)
    return root


def _train(torchrun: Launcher, job: Path, *flags: object, check: bool = True):  # noqa: ANN202
    return torchrun(job / "train.py", "--plan", "even", "--lr", "1e-3", *flags, nproc=2, cwd=job, check=check)


def _trained_weights(job: Path, steps: int) -> dict[str, torch.Tensor]:
    """Every weight (a tied one under each of its names) of the untouched model after ``steps`` steps
    trained as ``_train`` trains the job (seed 0, --lr 1e-3, train.py's other defaults)."""
    source = model_factory(str(job / "tiny"), batch_size=ROWS, seq_len=SEQ)
    model = build_reference(source.factory, seed=0)
    trainer = ReferenceTrainer(model, TrainConfig(steps=steps, microbatches=MICRO, lr=1e-3))
    data = JobData(source, None, seq_len=SEQ)
    for step in range(steps):
        trainer.step(*data.batch(step, ROWS * MICRO)[:2], microbatches=MICRO)
    return {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}


def _errors(proc) -> list[str]:  # noqa: ANN001
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("error:")]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_never_saves_into_another_run_s_folder_and_exports_its_own_weights(torchrun: Launcher, job: Path) -> None:
    """The issue's case: an earlier run's step 2 and 4 in ckpt/ (seed 1). A run asked to save there is
    refused before it trains, in one line, and the folder is as it was; without saving, its --export
    holds its own final weights: the untouched model's (seed 0) trained alike; --resume continues the
    earlier run and rotation keeps its newest checkpoint."""
    ckpt = job / "ckpt"
    _train(torchrun, job, "--seed", "1", "--steps", "4", "--ckpt-every", "2", "--ckpt-dir", ckpt)
    before = {p.name: (p / "meta.json").read_text() for p in ckpt.iterdir()}
    assert sorted(before) == ["step_00000002", "step_00000004"]

    refused = _train(torchrun, job, "--steps", "3", "--ckpt-every", "1", "--ckpt-keep", "2", "--ckpt-dir", ckpt,
                     "--export", job / "refused", check=False)
    assert refused.returncode != 0
    assert _errors(refused) == [f"error: checkpoint folder {ckpt} holds another run's checkpoints (steps 2-4 "
                                "(2 checkpoints)); nothing was written. Continue that run with --resume, or save this one "
                                "elsewhere with --ckpt-dir DIR."], refused.stderr[-3000:]
    assert "step     1" not in refused.stdout and not (job / "refused").exists()
    assert {p.name: (p / "meta.json").read_text() for p in ckpt.iterdir()} == before

    _train(torchrun, job, "--steps", "3", "--ckpt-dir", ckpt, "--export", job / "mine")  # saves nothing: allowed
    assert {p.name: (p / "meta.json").read_text() for p in ckpt.iterdir()} == before
    from safetensors.torch import load_file

    # against the untouched model, not a second run into a clean folder: the earlier run's weights
    # (seed 1) are far from these; a checkpoint's export is test_a_checkpoint_stores_each_weight_once's
    mine, expected = load_file(job / "mine" / "model.safetensors"), _trained_weights(job, 3)
    assert set(mine) == set(expected) and "lm_head.weight" in mine and "transformer.wte.weight" in mine
    for name, value in mine.items():
        torch.testing.assert_close(value, expected[name], atol=1e-5, rtol=0, msg=name)

    resumed = _train(torchrun, job, "--seed", "1", "--steps", "6", "--ckpt-every", "2", "--ckpt-keep", "1",
                     "--ckpt-dir", ckpt, "--resume")
    assert f"resumed from {ckpt / 'step_00000004'} at step 4" in resumed.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000006"]


@pytest.mark.slow
@pytest.mark.distributed
def test_after_a_resume_the_log_and_tensorboard_have_each_step_once(torchrun: Launcher, job: Path) -> None:
    """A run logs step 3 and stops before its checkpoint of step 3 is written (here: removed); the
    resumed run trains step 3 again, then on to step 5. --log-json then has steps 1-5 once each, step 3
    the resumed run's (equal to the first run's: batches and RNG are functions of the step), and so
    has TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = job / "relog"
    flags = ["--ckpt-dir", run / "ckpt", "--ckpt-every", "2", "--log-json", run / "log.json", "--tensorboard", run / "tb"]
    _train(torchrun, job, "--steps", "3", *flags)
    first = [json.loads(line) for line in (run / "log.json").read_text().splitlines()]
    assert [r["step"] for r in first] == [1, 2, 3]
    shutil.rmtree(run / "ckpt" / "step_00000003")
    proc = _train(torchrun, job, "--steps", "5", "--resume", *flags)
    assert "at step 2" in proc.stdout
    log = [json.loads(line) for line in (run / "log.json").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5]
    assert log[2]["loss"] == pytest.approx(first[2]["loss"], abs=1e-6)
    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss")] == [(r["step"], round(r["loss"], 5)) for r in log]
