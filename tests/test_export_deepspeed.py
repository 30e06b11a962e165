"""The DeepSpeed export trains: a user's own PipelineModule layers for GPT-2, cut by the exported file,
train on two gloo processes to the same losses as autopipe's own engine on the same cut, and as the
whole model trained in this process.

The plan is made for DeepSpeed from layer costs that make its best cut uneven (DeepSpeed's own
``partition_method`` would not find it), exported, and used twice: by the job's train.py (autopipe's
torch engine, ``--plan``) and by tests/_ds_user_train.py (DeepSpeed's PipelineModule with the exported
parts, GPT-2's embedding tied to its output layer with a TiedLayerSpec across the two stages).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _factories import tiny_gpt2_job
from _launch import Launcher

from autopipe import Profile, partition
from autopipe.costs.layer_costs import LayerCost
from autopipe.job.export import export_plan
from autopipe.runtime import (
    TokenData,
    TrainConfig,
    build_reference,
    build_stage,
    model_factory,
)
from autopipe.runtime.checks.reference import ReferenceTrainer

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.deepspeed]

HERE = Path(__file__).resolve().parent
STEPS, MICRO, ROWS, SEQ, LR, BLOCKS = 3, 4, 2, 16, 1e-3, 4


def _plan(job: Path) -> tuple[Profile, object]:
    source = model_factory(str(job / "tiny"), batch_size=ROWS, seq_len=SEQ)
    seq = build_stage(source.factory, source.args, source.kwargs, 1, pp_rank=0, pp_size=1).seq
    names = [info.name for info in seq.infos]
    heavy = {1: 4.0, 2: 4.0}  # two costly first blocks: the best cut is between them, not the even one
    tied = {i: tuple(info_tied) for i, info_tied in enumerate(_tied(seq))}
    prof = Profile(layers=tuple(LayerCost(i, n, heavy.get(i, 1.0) / 3, 2 * heavy.get(i, 1.0) / 3, params=100,
                                          tied=tied.get(i, ()))
                                for i, n in enumerate(names)), signature=seq.signature, model=str(job / "tiny"),
                   microbatch={"input_ids": [ROWS, SEQ]})  # fmt: skip
    return prof, partition(prof, 2, microbatches=MICRO, target="deepspeed", bandwidth=None)


def _tied(seq) -> list[list[str]]:  # noqa: ANN001
    return [[g.canonical for g in seq.tied if i in g.layers] for i in range(len(seq.layers))]


def test_deepspeed_user_pipeline_trains_like_the_whole_model(torchrun: Launcher, tmp_path: Path) -> None:
    tiny_gpt2_job(tmp_path, layers=BLOCKS, microbatches=MICRO, rows=ROWS, seq=SEQ)
    prof, plan = _plan(tmp_path)
    assert plan.boundaries == (0, 2, 7)  # uneven: embedding + 1 block | 3 blocks + norm + head
    plan.save(tmp_path / "plan.json")
    ds_file = tmp_path / "ds_pipeline.py"
    ds_file.write_text(export_plan(plan, prof, "deepspeed").text)
    # the user's script is compared with the whole model below; autopipe's own engine against the
    # whole model is test_jobs' (a launch of it here cost the suite ~25 s and checked nothing more)
    torchrun(HERE / "_ds_user_train.py", tmp_path / "tiny", ds_file, STEPS, LR, MICRO, ROWS, SEQ, tmp_path / "ds.json",
             nproc=2, cwd=tmp_path, env={"DS_ACCELERATOR": "cpu"}, pythonpath=[HERE], timeout=300)  # fmt: skip
    ds = json.loads((tmp_path / "ds.json").read_text())
    assert ds["parts"] == [0, 3, 8]  # the user's 8 layers (embedding in two) cut where the plan cuts
    # and the whole model trained here, micro-batch by micro-batch, without a pipeline
    source = model_factory(str(tmp_path / "tiny"), batch_size=ROWS, seq_len=SEQ)
    trainer = ReferenceTrainer(build_reference(source.factory, seed=0),
                               TrainConfig(steps=STEPS, microbatches=MICRO, lr=LR, grad_clip=0.0, seed=0))
    data = TokenData(None, vocab_size=source.vocab_size, seq_len=SEQ, seed=0)
    rows = ROWS * MICRO
    ref = [trainer.step(*source.batch(data.batch(s, rows), rows, step=s)) for s in range(STEPS)]
    assert ds["losses"] == pytest.approx(ref, abs=1e-5)
    assert len(set(round(x, 4) for x in ref)) == STEPS  # the loss moves: the steps really train
