"""``convert --engine deepspeed --ds-config my.json``: the user's DeepSpeed settings (ZeRO stage,
bf16, clip, batch keys, optimizer) are what the plan is made for, the job's ds_config.json is the
user's file with the plan's pipeline keys over it, each disagreement is one line, and DeepSpeed's
own engine trains the job with the merged file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopipe.errors import AutopipeError
from autopipe.job.ds_config import apply_ds_config, merge_ds_config
from autopipe.job.script import read_settings
from autopipe.job.settings import ConvertSettings

USER = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "train_batch_size": 8,
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 50000000},
    "bf16": {"enabled": True},
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.002, "betas": [0.9, 0.99], "weight_decay": 0.01}},
    "steps_per_print": 50,
    "wall_clock_breakdown": False,
}


def _settings(**kw: object) -> ConvertSettings:
    return ConvertSettings(**{"stages": 2, "engine": "deepspeed", **kw})


def test_the_file_s_settings_become_what_the_plan_is_made_for() -> None:
    """ZeRO stage, bf16, clip, micro-batch size and count, the optimizer and its settings."""
    s = apply_ds_config(_settings(), USER, "my.json")
    assert (s.zero, s.dtype, s.grad_clip, s.batch_size, s.microbatches) == (1, "bf16", 0.5, 2, 4)
    assert (s.optimizer, s.lr, s.betas, s.weight_decay) == ("adamw", 0.002, (0.9, 0.99), 0.01)
    same = apply_ds_config(_settings(microbatches=4, grad_clip=0.5), USER, "my.json")  # agreeing flags are fine
    assert same.microbatches == 4


@pytest.mark.parametrize(("change", "given", "message"), [
    ({"zero_optimization": {"stage": 0}}, {"zero": 1}, "says zero_optimization.stage 0 but --zero 1 was given"),
    ({}, {"microbatches": 8}, "says gradient_accumulation_steps 4 but --microbatches 8 was given"),
    ({}, {"lr": 0.1}, "says optimizer.params.lr 0.002 but --lr 0.1 was given"),
    ({"train_batch_size": 16}, {}, "train_batch_size 16 is not train_micro_batch_size_per_gpu x"),
    ({"fp16": {"enabled": True, "loss_scale": 0}}, {}, "enables fp16: DeepSpeed's fp16 (and its loss scaling)"),
    ({"scheduler": {"type": "WarmupLR"}}, {}, "autopipe builds the LR schedule itself"),
    ({"optimizer": {"type": "Lamb"}}, {}, "DeepSpeed's Lamb optimizer; autopipe builds AdamW, SGD or Adafactor"),
    ({"wall_clock_breakdown": True}, {}, "sets wall_clock_breakdown: DeepSpeed's pipeline engine then fails"),
])
def test_each_disagreement_is_one_line(change: dict, given: dict, message: str) -> None:
    """A convert option given another value than the file's, or what DeepSpeed's engine cannot train
    here, names both and what to do."""
    with pytest.raises(AutopipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_ds_config(_settings(**given), {**USER, **change}, "my.json")


def test_the_file_is_deepspeed_s_only() -> None:
    with pytest.raises(AutopipeError, match="use it with --engine deepspeed"):
        apply_ds_config(ConvertSettings(stages=2), USER, "my.json")


def test_the_job_s_file_keeps_the_user_s_keys_under_the_plan_s() -> None:
    """The plan's pipeline keys and what autopipe owns win; the user's other keys, nested ones too,
    and the user's logging over autopipe's defaults, stay."""
    job = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 6, "train_batch_size": 12,
           "zero_optimization": {"stage": 1}, "gradient_clipping": 0.5, "steps_per_print": 10**9}
    merged = merge_ds_config(USER, job)
    assert merged["gradient_accumulation_steps"] == 6 and merged["train_batch_size"] == 12
    assert merged["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 50000000}
    assert merged["wall_clock_breakdown"] is False and merged["bf16"] == {"enabled": True}
    assert merged["steps_per_print"] == 50


FACTORY = '''
import torch
from torch import nn

def build(batch_size=2):
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, (torch.randn(batch_size, 8),)
'''


@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.distributed
def test_a_converted_job_trains_on_deepspeed_with_the_merged_file(tmp_path: Path, torchrun) -> None:
    """convert with the user's file (ZeRO 1, bf16, clip 0.5, 2 x 4 micro-batches): the plan and
    train.py carry them, the job's ds_config.json is the user's with the plan's keys, and DeepSpeed's
    engine trains it 2 steps on 2 processes."""
    from autopipe.job.converter import convert

    (tmp_path / "net.py").write_text(FACTORY)
    user = {k: v for k, v in USER.items() if k != "train_batch_size"}
    (tmp_path / "my.json").write_text(json.dumps(user))
    result = convert(f"{tmp_path / 'net.py'}:build", stages=2, engine="deepspeed", ds_config=tmp_path / "my.json",
                     loss="mse", out=tmp_path / "job", estimate=True, progress=False, reserve="0")  # fmt: skip
    assert (result.plan.zero, result.plan.microbatches) == (1, 4)
    settings = read_settings(tmp_path / "job" / "train.py")
    assert (settings["dtype"], settings["grad_clip"], settings["batch_size"], settings["zero"]) == ("bf16", 0.5, 2, 1)
    written = json.loads((tmp_path / "job" / "ds_config.json").read_text())
    assert written["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 50000000}
    assert (written["gradient_accumulation_steps"], written["train_micro_batch_size_per_gpu"]) == (4, 2)
    assert written["steps_per_print"] == 50  # the user's own
    run = torchrun(tmp_path / "job" / "train.py", "--steps", "2", "--log-json", tmp_path / "log.json", nproc=2,
                   cwd=tmp_path / "job")  # fmt: skip
    assert "ZeRO 1" in run.stdout, run.stdout[-2000:]
    assert len((tmp_path / "log.json").read_text().splitlines()) == 2
