"""The two records of a job: what convert was asked for, and what train.py is made from.

``ConvertSettings`` holds every option of ``autopipe convert`` and checks them in one place, on
construction: a typo fails in milliseconds, before a minute of profiling. ``JobSettings`` is what
the job folder keeps: everything train.py needs to rebuild the model and run the plan.

Example:
    >>> ConvertSettings(stages=4, dtype="bfloat16", schedule="1F1B").dtype, ConvertSettings(stages=4).schedule
    ('bf16', 'auto')
    >>> ConvertSettings.from_options(stages=4, microbatch=8)
    Traceback (most recent call last):
    ...
    autopipe.errors.AutopipeError: unknown convert option 'microbatch'; did you mean 'microbatches'?
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..choices import RECOMPUTE_POLICIES, precision
from ..costs.engines import check_engine
from ..errors import AutopipeError, PartitionError
from ..planner.engine_choice import deepspeed_refusal
from ..planner.partitioner import zero_choices
from ..planner.schedule_choice import is_auto
from ..planner.schedules import normalize_schedule
from ..planner.targets import target_info
from ..units import parse_size

__all__ = ["ConvertSettings", "JobSettings", "refuse_unknown"]


def refuse_unknown(what: str, given: Iterable[str], valid: Iterable[str]) -> None:
    """Raise for the first name in ``given`` that is not in ``valid``, naming the closest valid one.

    Example:
        >>> refuse_unknown("train.py setting", ["sed"], ["seed", "seq_len"])
        Traceback (most recent call last):
        ...
        autopipe.errors.AutopipeError: unknown train.py setting 'sed'; did you mean 'seed'?
    """
    names = sorted(valid)
    for name in given:
        if name not in names:
            near = difflib.get_close_matches(name, names, n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"use one of {', '.join(names)}."
            raise AutopipeError(f"unknown {what} {name!r}; {hint}")


@dataclass(frozen=True)
class ConvertSettings:
    """Every option of ``convert``, checked and normalised when made (precision ``bf16``, schedule ``1f1b``).

    ``schedule="auto"`` (the default) plans every schedule the engine runs and keeps the fastest
    predicted step (autopipe.planner.schedule_choice); a named one is planned alone.

    Give ``stages`` (the cut for that many stages) or ``gpus`` with ``global_batch`` (search the
    whole layout of that cluster: the job gets the best layout's stages, replicas, micro-batch size
    and count, schedule, recompute and ZeRO stage; ``batch_size`` is then the size profiled at).
    """

    # ---- the layout: a fixed cut, or a cluster to search ----
    stages: int | None = None  # pipeline stages, one process each
    microbatches: int | None = None  # per step; default 2 x stages
    schedule: str = "auto"  # auto (the fastest the engine runs), gpipe, 1f1b, interleaved1f1b or zbv
    dp: int = 1  # data-parallel replicas of each stage; the plan's memory is per rank
    # tensor-parallel ranks inside each stage (world = stages x dp x tp); the torch engine only. None: 1, and
    # with gpus every degree dividing a node (1, 2, 4, 8) searched; a number (1 included) fixes it (ep likewise)
    tp: int | None = None
    sequence_parallel: bool = False  # with tp > 1: the activations between layers sharded on the sequence
    ep: int | None = None  # expert-parallel degree over each stage's dp replicas (divides dp; world unchanged); torch
    zero: int | str = 0  # ZeRO stage 0-3 the replicas shard with, or "auto" (the fastest that fits)
    gpus: int | None = None  # instead of stages: search the layout for this many devices (autopipe.cluster)
    gpus_per_node: int | None = None  # default: 8 for known GPUs; CPU: all on one host. With stages: the job's nodes
    global_batch: int | None = None  # with gpus: samples per step, all replicas together
    bandwidth_intra: float | None = None  # bytes/s per device inside a node (default per known GPU)
    bandwidth_inter: float | None = None  # bytes/s per device between nodes
    # ---- what the job trains ----
    batch_size: int | None = None  # rows per micro-batch, trained on and profiled with; None: the model's own (a factory's example, else 1)
    seq_len: int = 128
    dtype: str = "fp32"  # fp32, bf16 or fp16: autocast (16-bit matmuls) over fp32 weights and AdamW state
    recompute: str = "auto"  # per chunk: auto (the fastest that fits), none, selective or full
    engine: str = "torch"  # torch (torch.distributed.pipelining), deepspeed (PipelineModule) or auto (the faster that runs)
    target: str | None = None  # plan for another engine's trainer (torchtitan, megatron, deepspeed, fqns): its cuts only
    loss: str = "auto"  # auto (a factory's, else the model's own), model, cross_entropy or mse (vs the data's targets)
    data: str | os.PathLike[str] | None = None  # the job's --data, checked against the model before profiling
    seed: int = 0  # the initial weights' and the synthetic data's
    eval_data: str | os.PathLike[str] | None = None  # the job's --eval-data (held-out), checked like data
    # ---- how it is optimised (train.py's defaults; the plan counts the optimizer's state) ----
    optimizer: str = "adamw"  # adamw, sgd or adafactor (torch's)
    lr: float = 3e-4
    weight_decay: float = 0.1  # on matrices only
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's
    momentum: float = 0.9  # SGD's (0: plain SGD, no state)
    warmup_steps: int = 0  # steps of linear LR warmup (train.py's --warmup)
    lr_schedule: str = "cosine"  # after the warmup: cosine, linear or constant
    grad_clip: float = 1.0  # global gradient-norm clip (0: off)
    # ---- how layers are costed ----
    device: str = "cpu"  # profile on cpu or cuda; with estimate also a known GPU (a100, h100, h200)
    estimate: bool = False  # run nothing: cost layers from FLOPs and bytes on the meta device
    memory_limit: str | int | None = "device"  # per device, like "80GiB"; "device": the GPU's (none on CPU); None: no limit
    reserve: str | int | None = None  # runtime memory per rank beyond the tensors, like "80MiB"; None: measured once
    repeats: int = 5  # timed runs per measured layer
    warmup: int = 2  # untimed runs per measured layer
    progress: bool = True  # show the profiler's progress
    # ---- DeepSpeed ----
    ds_config: str | os.PathLike[str] | None = None  # your ds_config.json (--engine deepspeed): its ZeRO stage, bf16,
    # clip and batch keys are what the plan is made for; the job's ds_config.json is it with the plan's pipeline keys
    # ---- where the job goes ----
    out: str | os.PathLike[str] | None = None  # the job folder; default jobs/<model name>
    force: bool = False  # replace the job files of an existing folder (other files stay)
    # the degrees given ("tp", "ep"), which a search keeps fixed; set from tp and ep (a copy made by
    # dataclasses.replace keeps its original's and adds any it changes above 1)
    fixed: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        given = tuple(n for n in ("tp", "ep") if getattr(self, n) is not None)
        if self.fixed is not None:  # a copy: what its original fixed, and any degree set above 1 since
            given = tuple(n for n in ("tp", "ep") if n in self.fixed or getattr(self, n) not in (None, 1))
        self._set(fixed=given, tp=1 if self.tp is None else self.tp, ep=1 if self.ep is None else self.ep)
        # the cheap checks, in the order a person fixes them: the layout, then the engine's limits
        if self.gpus is not None:
            if self.stages is not None or self.microbatches is not None or self.dp != 1:
                what = "--stages" if self.stages is not None else "--microbatches" if self.microbatches is not None else "--dp"
                raise PartitionError(f"{what} fixes what --gpus searches; give one or the other.")
            if self.global_batch is None or self.global_batch < 1:
                raise PartitionError("--gpus needs --global-batch N: the samples per step that the layouts divide among replicas.")
        elif self.stages is None:
            raise PartitionError("give --stages N (the cut for N stages) or --gpus N (search the whole layout).")
        elif self.stages < 1:
            raise PartitionError(f"--stages must be at least 1, got {self.stages}.")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise PartitionError(f"--gpus-per-node must be at least 1, got {self.gpus_per_node}.")
        if self.gpus_per_node is not None and self.gpus is None:
            world = self.stages * self.dp * self.tp  # type: ignore[operator]
            tp = f" x --tp {self.tp}" if self.tp > 1 else ""
            if world > self.gpus_per_node and world % self.gpus_per_node:
                raise PartitionError(f"--stages {self.stages} x --dp {self.dp}{tp} = {world} processes is not a whole number of "
                                     f"nodes of {self.gpus_per_node} (--gpus-per-node); change one of them.")
            if self.tp > self.gpus_per_node or self.gpus_per_node % self.tp:
                raise PartitionError(f"--tp {self.tp} does not fit nodes of {self.gpus_per_node} (--gpus-per-node): a stage's "
                                     f"tp ranks share one node; use a tp that divides {self.gpus_per_node}.")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise PartitionError(f"--tp must be a whole number of ranks, at least 1, got {self.tp!r}.")
        if self.gpus is not None and self.gpus_per_node is not None and self.tp > 1 and self.gpus_per_node % self.tp:
            raise PartitionError(f"--tp {self.tp} does not fit nodes of {self.gpus_per_node} (--gpus-per-node): a stage's "
                                 f"tp ranks share one node; use a tp that divides {self.gpus_per_node}.")
        if self.sequence_parallel and self.tp == 1 and self.gpus is None:  # with --gpus: where the search picks tp > 1
            raise PartitionError("--sequence-parallel shards the activations over a stage's tp ranks: give --tp 2 or more "
                                 "with it, or drop it.")
        if self.tp > 1 and self.engine == "deepspeed":
            raise AutopipeError(f"--tp {self.tp} on DeepSpeed: its PipelineModule runs no tensor parallelism here; "
                                "use --engine torch for --tp.")
        if self.tp > 1 and self.engine == "auto":  # only torch's engine runs tp
            self._set(engine="torch")
        self._check_ep()
        if self.microbatches is not None and self.microbatches < 1:
            raise PartitionError(f"--microbatches must be at least 1, got {self.microbatches}.")
        schedule = "auto" if is_auto(self.schedule) else normalize_schedule(self.schedule)
        self._set(engine=check_engine(self.engine), dtype=precision(self.dtype), schedule=schedule)
        deepspeed = self.engine == "deepspeed"
        why = deepspeed_refusal(schedule=self._runs, dtype=self.dtype) if deepspeed else None
        if why:  # recompute and ZeRO are checked below, after their own names
            raise AutopipeError(f"{why}: drop it or use --engine torch (or auto).")
        if self.memory_limit is not None and str(self.memory_limit).strip().lower() not in ("device", "none"):
            parse_size(self.memory_limit)  # a bad size is refused before any work
        if self.recompute not in RECOMPUTE_POLICIES:
            raise AutopipeError(f"unknown --recompute {self.recompute!r}; use one of {', '.join(RECOMPUTE_POLICIES)}.")
        if deepspeed:  # DeepSpeed's engine recomputes nothing the plan asks for: plan without it
            if self.recompute in ("selective", "full"):
                raise AutopipeError(f"{deepspeed_refusal(schedule=self._runs, recompute=self.recompute)}: drop it or "
                                    "use --engine torch (or auto).")
            self._set(recompute="none")
        if self.target is not None:
            self._set(target=target_info(self.target).key)  # an unknown engine is refused before any work
        zero_choices(self.zero, self.dp)  # a bad --dp/--zero
        from ..runtime.training.optim import (
            TrainConfig,  # the optimizer's settings, checked as train.py will
        )

        trained = TrainConfig(optimizer=self.optimizer, lr=self.lr, weight_decay=self.weight_decay, betas=tuple(self.betas),
                              momentum=self.momentum, warmup=self.warmup_steps, lr_schedule=self.lr_schedule,
                              grad_clip=self.grad_clip)
        self._set(optimizer=trained.optimizer, betas=trained.betas)
        if deepspeed and (self.zero == "auto" or int(self.zero) > 1):
            raise AutopipeError(f"{deepspeed_refusal(schedule=self._runs, zero=self.zero)}: use --zero 0 or 1, or "
                                "--engine torch (or auto).")
        if self.estimate and self.device not in ("cpu", "cuda") and not _is_known_target(self.device):
            raise AutopipeError(f"unknown --device {self.device!r}; use cpu or cuda (with --estimate also a100, h100, h200).")
        if not self.estimate and self.device not in ("cpu", "cuda"):
            raise AutopipeError(f"--device {self.device!r} can only be measured as cpu or cuda; add --estimate for {self.device}.")

    @classmethod
    def from_options(cls, **options: Any) -> ConvertSettings:
        """The record from keyword options, a misspelled one refused with the name it was meant to be."""
        refuse_unknown("convert option", options, cls.names())
        return cls(**options)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @property
    def optimizer_state(self) -> str:
        """The optimizer as the memory model names its state (``optimizer_state_factor``)."""
        if self.optimizer == "sgd":
            return "sgd-momentum" if self.momentum else "sgd"
        return self.optimizer

    def optimizer_settings(self) -> dict[str, Any]:
        """What train.py is written with for the optimizer and its schedule."""
        return {"optimizer": self.optimizer, "lr": self.lr, "weight_decay": self.weight_decay, "betas": tuple(self.betas),
                "momentum": self.momentum, "warmup": self.warmup_steps, "lr_schedule": self.lr_schedule,
                "grad_clip": self.grad_clip}

    @property
    def chunks_per_stage(self) -> int:
        """Chunks each pipeline rank runs: two under the interleaved and V-shaped schedules; under auto
        the fewest any schedule needs (one: auto never refuses what 1F1B can run)."""
        return 2 if self.schedule in ("interleaved1f1b", "zbv") else 1

    @property
    def _runs(self) -> str:
        """The schedule DeepSpeed's refusals judge: auto there means its own 1F1B."""
        return "1f1b" if self.schedule == "auto" else self.schedule

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def _check_ep(self) -> None:
        """Expert parallelism (autopipe.runtime.stage.expert_parallel): ep divides dp (with --gpus: the
        devices; the search keeps the layouts whose dp it divides), on torch's engine, any ZeRO stage."""
        ep = self.ep
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise PartitionError(f"--ep must be a whole number of replicas, at least 1, got {ep!r}.")
        if ep == 1:
            return
        if self.gpus is not None and self.gpus % ep:
            raise PartitionError(f"--ep {ep} does not divide --gpus {self.gpus}: the experts are shared out over ep "
                                 "replicas of a stage; pick an ep that divides the devices.")
        if self.gpus is None and self.dp % ep:
            raise PartitionError(f"--ep {ep} must divide --dp {self.dp}: the experts are shared out over ep of a stage's "
                                 "replicas; pick an ep that divides dp.")
        if self.engine == "deepspeed":
            raise AutopipeError(f"--ep {ep} on DeepSpeed: its PipelineModule runs no expert parallelism here; use "
                                "--engine torch for --ep.")
        if self.engine == "auto":  # only torch's engine runs ep
            self._set(engine="torch")

    def _set(self, **normalised: Any) -> None:
        for name, value in normalised.items():  # frozen: only __post_init__ normalises
            object.__setattr__(self, name, value)


def _is_known_target(name: str) -> bool:
    from ..costs.devices import KNOWN_DEVICES  # torch: only when a GPU is named

    return name.lower() in KNOWN_DEVICES


@dataclass(frozen=True)
class JobSettings:
    """How the job was made: everything train.py needs to rebuild the model and run the plan."""

    model: str  # as given to convert: a built-in name, a HF folder, or a factory module:function
    stages: int
    microbatches: int
    schedule: str
    batch_size: int = 1  # per micro-batch
    seq_len: int = 128
    dtype: str = "fp32"  # training precision: fp32 | bf16 | fp16 (autocast, fp32 master weights)
    engine: str = "torch"  # torch | deepspeed
    device: str = "cpu"  # where it was profiled
    seed: int = 0
    loss: str = "auto"  # auto | model | cross_entropy | mse
    data: str | None = None  # the job's default --data (absolute path); None: synthetic
    eval_data: str | None = None  # the job's default --eval-data (absolute path); None: no evaluation
    optimizer: str = "adamw"  # adamw | sgd | adafactor, and its settings (train.py's defaults)
    lr: float = 3e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    momentum: float = 0.9
    warmup: int = 0
    lr_schedule: str = "cosine"
    grad_clip: float = 1.0
    ds_config: str | None = None  # the user's own DeepSpeed config the job's ds_config.json merges (absolute path)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_options(cls, **options: Any) -> JobSettings:
        """The record from keyword options, a misspelled one refused with the name it was meant to be."""
        refuse_unknown("train.py setting", options, (f.name for f in fields(cls)))
        return cls(**options)
