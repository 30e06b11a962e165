"""The optimizer and its schedule are the user's: AdamW, SGD or Adafactor (torch's), learning rate,
weight decay, betas or momentum, warmup, cosine / linear / constant, clipping; from train.py's
flags and from convert into the job, the plan's memory following the optimizer's state.

The pipelined job equals the untouched model trained in one process with the same settings
(losses, within 1e-5); a resume with an optimizer whose state appears at its first step (SGD's
momentum, Adafactor's factors) continues exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from _factories import tiny_gpt2_job
from _launch import Launcher

from autopipe.costs.layer_costs import Profile
from autopipe.errors import AutopipeError
from autopipe.job.script import read_settings
from autopipe.planner.memory import layer_memory
from autopipe.planner.partitioner import partition
from autopipe.runtime import JobData, TrainConfig, build_reference, model_factory
from autopipe.runtime.checkpoints.store import materialize_state_
from autopipe.runtime.checks.reference import ReferenceTrainer, unique_parameters
from autopipe.runtime.training.optim import lr_factor, make_optimizer

MICRO, ROWS, SEQ = 2, 2, 16
TOL = 1e-5


def test_lr_schedules_after_the_warmup() -> None:
    """Linear warmup, then cosine or linear to lr x min_lr_ratio at the last step, or constant."""
    cos = TrainConfig(steps=10, warmup=2)
    lin = TrainConfig(steps=10, warmup=2, lr_schedule="linear")
    const = TrainConfig(steps=10, warmup=2, lr_schedule="constant")
    for config in (cos, lin, const):
        assert [lr_factor(s, config) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    assert lr_factor(10, cos) == pytest.approx(0.1) and lr_factor(10, lin) == pytest.approx(0.1)
    assert lr_factor(6, cos) == pytest.approx(0.1 + 0.9 * 0.5) and lr_factor(6, lin) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(4, lin) == pytest.approx(0.1 + 0.9 * 0.75) and lr_factor(4, cos) > lr_factor(4, lin)
    assert {lr_factor(s, const) for s in range(2, 11)} == {1.0}


def test_each_optimizer_is_torch_s_with_the_settings_and_decay_on_matrices() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    params = dict(net.named_parameters())
    adamw = make_optimizer(params, TrainConfig(lr=1e-3, betas=(0.8, 0.9), weight_decay=0.05))
    sgd = make_optimizer(params, TrainConfig(optimizer="sgd", lr=0.1, momentum=0.5))
    ada = make_optimizer(params, TrainConfig(optimizer="adafactor", lr=0.01))
    assert type(adamw) is torch.optim.AdamW and adamw.defaults["betas"] == (0.8, 0.9)
    assert adamw.defaults["fused"] is True and not adamw.defaults["foreach"]  # CPU parameters: the fused kernel
    assert sgd.defaults["foreach"] is True
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.5
    assert type(ada) is torch.optim.Adafactor and ada.defaults["lr"] == 0.01
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.05, 0.0]
    assert [len(g["params"]) for g in adamw.param_groups] == [1, 3]  # only the weight matrix decays


@pytest.mark.parametrize("bad,message", [
    (dict(optimizer="lion"), "--optimizer lion: use adamw, sgd, adafactor"),
    (dict(lr_schedule="step"), "--lr-schedule step: use cosine, linear, constant"),
    (dict(lr=0.0), "--lr 0.0 must be > 0"),
    (dict(betas=(0.9, 1.5)), "--betas 0.9,1.5: give two numbers in [0, 1)"),
])
def test_bad_settings_are_one_line(bad: dict, message: str) -> None:
    with pytest.raises(AutopipeError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**bad)


@pytest.mark.parametrize("name", ["sgd", "adafactor"])
def test_state_made_for_a_load_moves_no_weight(name: str) -> None:
    """materialize_state_ (before a checkpoint's state is loaded in place): every parameter gets its
    state, no parameter changes, and the learning rate is put back."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 1))
    params = dict(net.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = make_optimizer(params, TrainConfig(optimizer=name, lr=0.3, weight_decay=0.1))
    assert not opt.state
    materialize_state_(opt)
    assert all(opt.state[p] for p in params.values())
    assert all(torch.equal(p, before[n]) for n, p in params.items())
    assert [g["lr"] for g in opt.param_groups] == [0.3, 0.3]


def test_convert_writes_the_optimizer_into_the_job_and_the_plan_counts_its_state(tmp_path: Path) -> None:
    """convert --optimizer/--lr/... become train.py's defaults; the plan's optimizer memory follows the
    state each optimizer keeps (AdamW 2x the weights, SGD with momentum 1x, Adafactor 1%)."""
    from autopipe.job.converter import convert

    tiny = tiny_gpt2_job(tmp_path, layers=2, microbatches=MICRO, rows=ROWS, seq=SEQ)
    result = convert(str(tiny), stages=2, estimate=True, seq_len=SEQ, batch_size=ROWS, reserve=0, progress=False,
                     out=tmp_path / "job", optimizer="sgd", lr=0.05, momentum=0.8, weight_decay=0.0, warmup_steps=3,
                     lr_schedule="linear", grad_clip=0.5, memory_limit="none")
    values = read_settings(tmp_path / "job" / "train.py")
    assert {k: values[k] for k in ("optimizer", "lr", "momentum", "weight_decay", "warmup", "lr_schedule", "grad_clip")} \
        == {"optimizer": "sgd", "lr": 0.05, "momentum": 0.8, "weight_decay": 0.0, "warmup": 3, "lr_schedule": "linear",
            "grad_clip": 0.5}
    assert result.plan.optimizer == "sgd-momentum"
    prof = Profile.from_costs([1.0] * 4, param_bytes=[1000, 2000, 3000, 4000])
    state = {o: sum(layer_memory(prof, o).optimizer) for o in ("adamw", "sgd-momentum", "sgd", "adafactor")}
    assert state == {"adamw": 20000, "sgd-momentum": 10000, "sgd": 0, "adafactor": 100}
    plans = {o: partition(prof, 2, optimizer=o, bandwidth=None) for o in ("adamw", "adafactor")}
    assert max(plans["adafactor"].rank_memory) < max(plans["adamw"].rank_memory)
    with pytest.raises(AutopipeError, match="--optimizer lion"):
        convert(str(tiny), stages=2, estimate=True, optimizer="lion", out=tmp_path / "never", progress=False)
    assert not (tmp_path / "never").exists()


def test_adafactor_s_state_is_within_what_the_plan_charges() -> None:
    """The 1% charged for Adafactor covers torch's Adafactor on GPT-2 blocks of width 256 (rows and
    columns of each matrix, whole vectors), measured after a real step."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=4096, n_positions=64))
    params = unique_parameters(model)
    opt = make_optimizer(params, TrainConfig(optimizer="adafactor"))
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    weights = sum(p.numel() * p.element_size() for p in params.values())
    assert 0 < state <= 0.01 * weights


# ---- real runs ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("optim")
    tiny_gpt2_job(root, layers=2, microbatches=MICRO, rows=ROWS, seq=SEQ)
    return root


def _reference(job: Path, config: TrainConfig, dp: int = 1) -> list[float]:
    source = model_factory(str(job / "tiny"), batch_size=ROWS, seq_len=SEQ)
    data = JobData(source, None, seq_len=SEQ)
    trainer = ReferenceTrainer(build_reference(source.factory, seed=0), config)
    rows = ROWS * MICRO * dp
    return [trainer.step(*data.batch(step, rows)[:2], microbatches=MICRO * dp) for step in range(config.steps)]


def _losses(torchrun: Launcher, job: Path, name: str, *flags: object, nproc: int = 2) -> list[float]:
    log = job / f"{name}.json"
    log.unlink(missing_ok=True)
    torchrun(job / "train.py", "--plan", "even", "--log-json", log, *flags, nproc=nproc, cwd=job)
    return [r["loss"] for r in map(json.loads, log.read_text().splitlines())]


SETTINGS = {
    "sgd": (["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.8", "--weight-decay", "0.01", "--warmup", "1",
             "--lr-schedule", "linear", "--grad-clip", "0.5"],
            dict(optimizer="sgd", lr=0.05, momentum=0.8, weight_decay=0.01, warmup=1, lr_schedule="linear", grad_clip=0.5)),
    "adafactor": (["--optimizer", "adafactor", "--lr", "0.01", "--lr-schedule", "constant", "--grad-clip", "0"],
                  dict(optimizer="adafactor", lr=0.01, lr_schedule="constant", grad_clip=0.0)),
    "adamw": (["--lr", "2e-3", "--betas", "0.8,0.99", "--weight-decay", "0.2", "--warmup", "2"],
              dict(lr=2e-3, betas=(0.8, 0.99), weight_decay=0.2, warmup=2)),
}


@pytest.mark.slow
@pytest.mark.distributed
def test_adamw_s_flags_pipelined_equal_the_untouched_model_trained_alike(torchrun: Launcher, job: Path) -> None:
    """AdamW with every flag set; SGD and Adafactor are checked against the untouched model by the
    resume test below (its uninterrupted run), which saves the suite two launches."""
    flags, settings = SETTINGS["adamw"]
    name = "adamw"
    losses = _losses(torchrun, job, name, "--steps", "4", *flags)
    assert losses == pytest.approx(_reference(job, TrainConfig(steps=4, microbatches=MICRO, **settings)), abs=TOL)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("name,zero", [("adafactor", 0), ("sgd", 1)])
def test_a_resume_continues_optimizer_state_made_at_the_first_step(torchrun: Launcher, job: Path, name: str,
                                                                   zero: int) -> None:
    """Adafactor's factors and SGD's momentum exist from their first step: a checkpoint of step 2,
    resumed, continues steps 3-4 as the uninterrupted run (SGD on 2 replicas under ZeRO 1, its state
    sharded by torch's ZeroRedundancyOptimizer)."""
    flags, settings = SETTINGS[name]
    dp = 2 if zero else 1
    layout = ["--dp", str(dp), "--zero", str(zero)]
    ckpt = job / f"ckpt-{name}"
    shutil.rmtree(ckpt, ignore_errors=True)
    whole = _losses(torchrun, job, f"{name}-whole", "--steps", "4", *flags, *layout, "--ckpt-every", "2",
                    "--ckpt-dir", ckpt, nproc=2 * dp)
    shutil.rmtree(ckpt / "step_00000004")
    resumed = _losses(torchrun, job, f"{name}-resumed", "--steps", "4", *flags, *layout, "--ckpt-dir", ckpt, "--resume",
                      nproc=2 * dp)
    assert resumed == pytest.approx(whole[2:], abs=TOL)
    assert whole == pytest.approx(_reference(job, TrainConfig(steps=4, microbatches=MICRO, **settings), dp=dp), abs=TOL)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.deepspeed
def test_deepspeed_trains_with_the_configured_optimizer(torchrun: Launcher, job: Path) -> None:
    """SGD on DeepSpeed's engine (its clipping mixed into torch's SGD) equals the untouched model's."""
    flags, settings = SETTINGS["sgd"]
    losses = _losses(torchrun, job, "ds-sgd", "--engine", "deepspeed", "--steps", "3", *flags)
    assert losses == pytest.approx(_reference(job, TrainConfig(steps=3, microbatches=MICRO, **settings)), abs=TOL)
