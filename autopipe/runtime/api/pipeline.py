"""This rank's pipeline, for a training loop of your own: ``autopipe.pipeline(model, plan)``.

A generated train.py is one loop over the runtime; a user with a loop of their own (their
DataLoader, their hooks, their logging) takes the same pieces from one call:

    import autopipe
    pipe = autopipe.pipeline("my_model.py:build", "jobs/mine/plan.json")   # every rank calls it
    for step, (x, y) in enumerate(loader):                                 # this replica's rows
        pipe.forward_backward(x, labels=y)   # the schedule: every micro-batch forward and backward
        norm = pipe.clip_gradients()         # tied sums, the global norm, the clip
        stats = pipe.optimizer_step()        # the update and the LR schedule (or: pipe.step(...))
    pipe.close()

Every rank builds only its own chunks (the model on the meta device, then this rank's tensors),
on the device ``init_dist`` gives it; ``pipe.modules`` are those chunks, ``pipe.parameters`` and
``pipe.optimizer`` this rank's share, ``pipe.trainer`` the ``Trainer`` underneath (checkpoints:
``rt.save_checkpoint(pipe.trainer, dir)``). Launch the script with torchrun (or ``python`` for
one process running every stage).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...errors import AutopipeError
from ...planner.plan import Plan, load_plan
from ...planner.stage_plan import StagePlan, plan_placement
from ..data.factory import ModelSource, model_factory
from ..data.losses import make_loss
from ..logs.steps import StepStats
from ..process.distenv import DistEnv, init_dist
from ..process.lifecycle import check_launch
from ..stage.build import StageBuild, build_stage
from ..torch_engine.trainer import Trainer
from ..training.optim import TrainConfig

__all__ = ["Pipeline", "pipeline"]

Loss = str | Callable[[Any, Any], torch.Tensor] | None


@dataclass
class Pipeline:
    """This rank's part of a pipeline-parallel model (see the module docstring)."""

    env: DistEnv  # this rank: its device, its pipeline and replica ranks, the process groups
    build: StageBuild  # this rank's chunks of the flattened model, and the plan as placed
    trainer: Trainer  # the schedule, the data-parallel wrapping, the optimizer and its LR schedule

    # ---- one step, or its three phases -------------------------------------------------------
    def step(self, *args: Any, target: torch.Tensor | None = None, **kwargs: Any) -> StepStats:
        """One optimizer step on this replica's batch: the model's own arguments (``target`` for a
        loss that needs one). Every rank passes the same batch; the first stage reads its inputs,
        the last one its labels and target."""
        return self.trainer.step(args, kwargs, target)

    def forward_backward(self, *args: Any, target: torch.Tensor | None = None, **kwargs: Any) -> None:
        """Every micro-batch of the batch forward and backward under the plan's schedule."""
        self.trainer.forward_backward(args, kwargs, target)

    def clip_gradients(self) -> float:
        """Tied-gradient sums, the global gradient norm (returned) and the clip to ``grad_clip``."""
        return self.trainer.clip_gradients()

    def optimizer_step(self) -> StepStats:
        """The optimizer's update and the LR schedule's step; what the step did."""
        return self.trainer.optimizer_step()

    # ---- what this rank holds ----------------------------------------------------------------
    @property
    def modules(self) -> list[nn.Module]:
        """This rank's chunks, in pipeline order, on its device."""
        return list(self.build.chunks)

    @property
    def parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters by the untouched model's names (each tied tensor once)."""
        return dict(self.trainer.params)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    @property
    def plan(self) -> StagePlan:
        """The plan as this run placed it: each chunk's rank, the schedule."""
        return self.build.plan

    @property
    def is_first(self) -> bool:
        """Whether this rank runs the first chunk (it reads the batch's inputs)."""
        return self.trainer.is_first

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last chunk (it reads the labels and targets, and has the loss)."""
        return self.trainer.is_last

    @property
    def step_count(self) -> int:
        return self.trainer.step_count

    def close(self) -> None:
        """Tear the process groups down (every rank, at the end)."""
        self.env.close()


def pipeline(
    model: str | Callable[[], nn.Module],
    plan: str | os.PathLike[str] | Plan | StagePlan | int,
    *,
    example: Sequence[Any] | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    loss: Loss = None,
    config: TrainConfig | None = None,
    dp: int | None = None,
    schedule: str | None = None,
    weights: str | None = None,
    tp: int | None = None,
    ep: int | None = None,
) -> Pipeline:
    """This rank's pipeline of ``model`` cut by ``plan``, ready for a loop of your own.

    Args:
        model: a model spec as ``autopipe convert`` takes it (a built-in name, a HF folder, or
            ``file.py:function`` returning the model and one micro-batch of example inputs), or a
            function returning the model, with ``example`` (and ``example_kwargs``) its inputs.
        plan: plan.json (``autopipe convert`` or ``autopipe plan`` wrote it), a ``Plan``, or a
            number of stages to cut the layers evenly.
        loss: ``None`` (the model's own, e.g. a HF model given ``labels``; or the factory's),
            ``"cross_entropy"``, ``"mse"``, or ``loss(outputs, target)``.
        config: the optimizer, its LR schedule, micro-batches, precision, clip
            (``autopipe.runtime.TrainConfig``); default: its defaults with the plan's
            micro-batches and ZeRO stage.
        dp: data-parallel replicas of each stage (default: the plan's; world = dp x stages).
        schedule: torch's schedule to run (default: the plan's).
        weights: a safetensors file or HF folder to start from (default: seeded initialisation,
            the same on every layout).
        tp: tensor-parallel ranks inside each stage (default: the plan's; world = dp x stages x tp).
        ep: expert-parallel degree over each stage's replicas (default: the plan's; divides dp).

    Every rank calls it with the same arguments, under torchrun (or ``python`` alone).
    """
    record = _stage_plan(plan)
    dp = dp if dp is not None else (record.dp if record is not None else 1)
    placement = plan_placement(plan) if isinstance(plan, (str, os.PathLike)) else \
        (record.placement if record is not None else "pipeline-inner")
    source = _source(model, example, example_kwargs, loss)
    config = config or TrainConfig(microbatches=record.microbatches if record is not None and record.microbatches else 4,
                                   zero=record.zero if record is not None else 0)
    tp = tp if tp is not None else (record.tp if record is not None else 1)
    ep = ep if ep is not None else (record.ep if record is not None else 1)
    env = init_dist(dp=dp, placement=placement, tp=tp, ep=ep)
    try:
        cut: StagePlan | int = record if record is not None else int(plan)  # type: ignore[arg-type]
        check_launch(cut, env.pp_size, env.dp_size, plan_path=str(plan) if not isinstance(plan, int) else "the plan",
                     tp=env.tp_size)
        build = build_stage(source.factory, source.args, source.kwargs, cut, pp_rank=env.pp_rank, pp_size=env.pp_size,
                            schedule=schedule, seed=config.seed, weights=weights or source.weights, device=env.device,
                            autocast=config.autocast_dtype, tp_mesh=env.tp_mesh, ep_group=env.ep_group)
        trainer = Trainer(build, env, config, loss_fn=make_loss(source.loss))
    except BaseException:
        env.close()
        raise
    return Pipeline(env, build, trainer)


def _stage_plan(plan: str | os.PathLike[str] | Plan | StagePlan | int) -> StagePlan | None:
    """The record the runtime runs, or None for a stage count (an even cut)."""
    if isinstance(plan, bool):
        raise AutopipeError(f"plan={plan!r}: give plan.json's path, a Plan, or a number of stages.")
    if isinstance(plan, int):
        return None
    if isinstance(plan, Plan):
        return plan.stage_plan()
    if isinstance(plan, StagePlan):
        return plan
    return load_plan(plan)


def _source(model: str | Callable[[], nn.Module], example: Sequence[Any] | None,
            example_kwargs: Mapping[str, Any] | None, loss: Loss) -> ModelSource:
    """How every rank rebuilds the model, with one micro-batch of example inputs."""
    if isinstance(model, str):
        source = model_factory(model, batch_size=None, seq_len=128, loss="auto" if loss is None else loss)
        if example is not None or example_kwargs is not None:  # the caller's shapes win over the factory's
            source.args, source.kwargs = tuple(example or ()), dict(example_kwargs or {})
        return source
    if not callable(model) or isinstance(model, nn.Module):
        raise AutopipeError("pipeline(model=...) takes a model spec (like 'my_model.py:build') or a function that "
                            "builds the model: every rank builds it on the meta device and keeps only its own part.")
    if example is None and example_kwargs is None:
        raise AutopipeError("pipeline(model=<function>) needs example=(...): one micro-batch of the model's inputs "
                            "(the shapes it is traced with).")
    name = getattr(model, "__qualname__", type(model).__name__)
    return ModelSource(name=name, factory=model, args=tuple(example or ()), kwargs=dict(example_kwargs or {}),
                       loss="model" if loss is None else loss)
