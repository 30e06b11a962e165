"""The DeepSpeed job clips by the whole model's gradient norm, as the unpipelined model does.

DeepSpeed's own ``gradient_clipping`` on a pipeline takes stage 0's norm only (issue 24: 8.56 where the
whole model's was 10.11), so under ZeRO 0 the job sets it to 0 and autopipe clips
(``autopipe.runtime.deepspeed_engine.trainer``): every stage's gradients, GPT-2's tied wte/lm_head counted once. Compared
here on the gradients themselves just after the clip, before AdamW's update (AdamW would hide the
scale a wrong norm gives): a tiny GPT-2 whose tie spans the two stages, one step on 2 processes
against the untouched model's gradients clipped by torch's ``clip_grad_norm_``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _factories import tiny_gpt2_job
from _launch import Launcher

from autopipe.runtime import TokenData, TrainConfig, build_reference, model_factory
from autopipe.runtime.checks.reference import ReferenceTrainer

MICRO, ROWS, SEQ = 2, 2, 16
CLIP = 0.05  # well under the first step's norm, so the clip scales every gradient


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.deepspeed
def test_deepspeed_job_clips_by_the_whole_models_norm(torchrun: Launcher, tmp_path: Path) -> None:
    """The clipped gradients of both stages equal the unpipelined model's clipped by its own norm
    (1e-5 relative to the largest), their joint norm is the clip, and the logged norm is the whole
    model's; stage 0's norm alone differs by far more, so a stage-0 clip fails here."""
    tiny_gpt2_job(tmp_path, layers=4, microbatches=MICRO, rows=ROWS, seq=SEQ)
    run = tmp_path / "run"
    run.mkdir()
    ran = torchrun(tmp_path / "train.py", "--engine", "deepspeed", "--steps", 1, "--grad-clip", CLIP, "--plan", "even",
                   "--ckpt-dir", run / "ckpt", "--log-json", run / "log.json", nproc=2, cwd=run,
                   env={"AUTOPIPE_TEST_GRADS": str(run), "AUTOPIPE_TEST_GRADS_AT": "clipped"},
                   pythonpath=[Path(__file__).parent / "probes"])  # fmt: skip
    # DeepSpeed says "... deepspeed_shm_comm_op built successfully" where it builds (or loads) that op
    assert "shm_comm" not in ran.stdout + ran.stderr, (ran.stdout + ran.stderr)[-2000:]

    source = model_factory(str(tmp_path / "tiny"), batch_size=ROWS, seq_len=SEQ)
    model = build_reference(source.factory, seed=0)
    trainer = ReferenceTrainer(model, TrainConfig(steps=1, microbatches=MICRO, lr=1e-3, grad_clip=0.0, seed=0))
    rows = ROWS * MICRO
    args, kwargs = source.batch(TokenData(None, vocab_size=source.vocab_size, seq_len=SEQ, seed=0).batch(0, rows), rows, step=0)
    trainer.forward_backward(args, kwargs)
    named = dict(model.named_parameters(remove_duplicate=False))
    raw = {n: p.grad.clone() for n, p in named.items()}
    whole = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))  # parameters(): the tie once
    clipped = {n: p.grad for n, p in named.items()}

    ranks = [torch.load(run / f"grads_rank{r}.pt", weights_only=True) for r in (0, 1)]
    stage0 = {id(named[n]): raw[n] for n in ranks[0]}  # each tensor once
    stage0_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in stage0.values()))
    assert whole > 2 * CLIP and abs(stage0_norm / whole - 1) > 0.01  # the test tells the two norms apart
    joint: dict[int, torch.Tensor] = {}
    for grads in ranks:
        for name, g in grads.items():
            ref = clipped[name]
            torch.testing.assert_close(g, ref, atol=1e-5 * float(ref.abs().max()), rtol=0, msg=name)
            joint[id(named[name])] = g
    assert len(joint) == len({id(p) for p in named.values()})  # every tensor of the model came from a stage
    assert math.sqrt(sum(float(g.double().pow(2).sum()) for g in joint.values())) == pytest.approx(CLIP, rel=1e-5)
    logged = json.loads((run / "log.json").read_text().splitlines()[0])
    assert logged["grad_norm"] == pytest.approx(whole, rel=1e-5)


def test_a_cpu_deepspeed_job_does_not_compile_the_shared_memory_all_reduce() -> None:
    """DeepSpeed's torch backend compiles ``deepspeed_shm_comm`` (its inference all-reduce) at the first
    init_distributed on a CPU whose compiler flags it has not built for: 76 s of one CI run's first
    DeepSpeed test. The CPU trainer marks the op incompatible first (skip_shm_comm_build), so DeepSpeed's
    own build step returns no op, and the job runs every collective on gloo."""
    import deepspeed
    from deepspeed.comm.torch import build_shm_op

    from autopipe.runtime.deepspeed_engine.trainer import skip_shm_comm_build

    table = deepspeed.ops.__compatible_ops__
    was = table.get("deepspeed_shm_comm")
    try:
        skip_shm_comm_build(deepspeed)
        assert table["deepspeed_shm_comm"] is False and build_shm_op() is None
    finally:
        table["deepspeed_shm_comm"] = was
