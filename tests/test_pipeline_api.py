"""``autopipe.pipeline(model, plan)``: this rank's pipeline for a training loop of the user's own,
checked against the user's model untouched (its own forward, at the job's weights): the gradients
of every parameter after ``forward_backward`` (before any step), and the losses of a plain training
script (examples/own_loop.py: its DataLoader, its loop, its hook) on 2 processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import autopipe
from autopipe.errors import AutopipeError
from autopipe.runtime import TrainConfig, untouched_model
from autopipe.runtime.checks.reference import ReferenceTrainer

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "own_loop.py"
sys.path.insert(0, str(EXAMPLE.parent))
import own_loop  # noqa: E402  (the example's model and data, as the user wrote them)

TOL = 1e-5

GRADS = '''
import sys, torch
import autopipe
from autopipe.runtime import TrainConfig
sys.path.insert(0, sys.argv[1])
import own_loop

pipe = autopipe.pipeline(f"{sys.argv[1]}/own_loop.py:build", int(sys.argv[2]),
                         config=TrainConfig(microbatches=own_loop.MICROBATCHES, grad_clip=0.0))
(ids,) = own_loop.dataset(1)[:]
pipe.forward_backward(ids, ids)
norm = pipe.clip_gradients()
grads = {name: p.grad.detach().clone() for name, p in pipe.parameters.items()}
torch.save({"grads": grads, "norm": norm, "modules": len(pipe.modules), "last": pipe.is_last},
           f"{sys.argv[3]}/rank{pipe.env.rank}.pt")
pipe.optimizer_step()
pipe.close()
'''


def _untouched() -> torch.nn.Module:
    """The example's model as its factory builds it, at the weights every rank of the job gives it."""
    return untouched_model(lambda: own_loop.build()[0], seed=0)


@pytest.mark.slow
@pytest.mark.distributed
def test_forward_backward_gives_every_rank_the_untouched_model_s_gradients(torchrun, tmp_path: Path) -> None:
    """2 ranks, the example's model (tied embedding and head, a mask made in forward): after
    forward_backward and clip_gradients (clip off), every parameter's gradient on the rank holding it
    equals the untouched model's on the same batch, the tied tensor's summed over both stages."""
    (tmp_path / "grads.py").write_text(GRADS)
    torchrun(tmp_path / "grads.py", EXAMPLE.parent, 2, tmp_path, nproc=2, cwd=tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["modules"] for r in ranks] == [1, 1] and [r["last"] for r in ranks] == [False, True]
    model = _untouched()
    (ids,) = own_loop.dataset(1)[:]
    for chunk in ids.chunk(own_loop.MICROBATCHES):  # the pipeline's loss: the micro-batches' mean
        (model(chunk, chunk) / own_loop.MICROBATCHES).backward()
    expected = {n: p.grad for n, p in model.named_parameters()}
    got = {name: g for r in ranks for name, g in r["grads"].items()}
    assert set(got) == set(expected)  # every parameter on some rank; the tied one by its first name
    for name, grad in got.items():
        torch.testing.assert_close(grad, expected[name], atol=TOL, rtol=0, msg=name)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in expected.values()]))
    assert ranks[0]["norm"] == ranks[1]["norm"] == pytest.approx(float(norm), rel=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_plain_training_script_over_pipeline_trains_as_the_untouched_model(torchrun, tmp_path: Path) -> None:
    """examples/own_loop.py on 2 processes (its own DataLoader and loop over forward_backward,
    clip_gradients, optimizer_step): 4 steps' losses and gradient norms equal the untouched model
    trained alike in one process (AdamW, clip 1.0, cosine LR over the steps)."""
    steps, lr = 4, 3e-3
    torchrun(EXAMPLE, "--plan", "2", "--steps", steps, "--lr", lr, "--log", tmp_path / "log.json", nproc=2, cwd=ROOT)
    logged = json.loads((tmp_path / "log.json").read_text())
    model = _untouched()
    trainer = ReferenceTrainer(model, TrainConfig(steps=steps, microbatches=own_loop.MICROBATCHES, lr=lr, grad_clip=1.0))
    expected = []
    for (ids,) in torch.utils.data.DataLoader(own_loop.dataset(steps), batch_size=own_loop.ROWS):
        expected.append(trainer.step((ids, ids), {}))
    assert [r["loss"] for r in logged] == pytest.approx(expected, abs=TOL)
    assert expected[-1] < expected[0]


def test_pipeline_refuses_a_model_it_cannot_rebuild_on_every_rank() -> None:
    """A built model instance, or a function without example inputs, is one line saying what to pass."""
    with pytest.raises(AutopipeError, match="a function that builds the model"):
        autopipe.pipeline(own_loop.TinyLM(), 1)
    with pytest.raises(AutopipeError, match=r"needs example=\(\.\.\.\)"):
        autopipe.pipeline(own_loop.TinyLM, 1)
    with pytest.raises(AutopipeError, match="give plan.json's path"):
        autopipe.pipeline(own_loop.TinyLM, True, example=(torch.zeros(2, 4, dtype=torch.long),) * 2)
