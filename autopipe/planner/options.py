"""PartitionOptions: every choice ``partition`` takes besides the profile, as one frozen record. No torch.

``partition(profile, stages, schedule=..., ...)`` builds this record from its keywords;
``partition(profile, options=PartitionOptions(...))`` takes one made elsewhere. Inside the planner
the record is what flows: a re-plan with one thing changed is ``dataclasses.replace(options, ...)``,
never the whole keyword list again. The record checks what it can without the profile, when made:
schedule, virtual stages and micro-batches together, recompute policy, ZeRO stage and replicas, the
memory limit's spelling, what a ``target`` engine runs. What needs the profile (enough layers for
the chunks, the limit "device" means, the weight share it measured, the cuts its names allow) is
partition's to check.

Example:
    >>> opts = PartitionOptions(4, schedule="Interleaved1F1B", microbatches=8)
    >>> opts.schedule, opts.v, opts.m
    ('interleaved1f1b', 2, 8)
    >>> PartitionOptions.from_options(stages=4, recompte="full")
    Traceback (most recent call last):
    ...
    autopipe.errors.PartitionError: unknown partition option 'recompte'; did you mean 'recompute'?
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Sequence

from ..choices import RECOMPUTE_POLICIES, ZERO_STAGES
from ..costs.engines import EngineCosts
from ..errors import PartitionError
from ..units import parse_size
from .schedules import check_schedule, check_weight_share, normalize_schedule
from .targets import check_target, target_info

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["PartitionOptions", "DEFAULT_BANDWIDTH", "zero_choices"]

# PCIe 4.0 x16 in practice: the slowest link a pipeline commonly crosses inside one machine.
DEFAULT_BANDWIDTH = 25e9


@dataclass(frozen=True)
class PartitionOptions:
    """What to plan: the pipeline's shape, its memory, its cut, the engine it is for (see ``partition``)."""

    stages: int
    """Pipeline ranks S."""

    microbatches: int | None = None
    """Micro-batches per step M; None: 2·S."""

    schedule: str = "1f1b"
    """gpipe, 1f1b, interleaved1f1b or zbv (any spelling ``normalize_schedule`` reads; kept canonical):
    the schedule simulated and minimised, and the activations each stage keeps in flight."""

    memory_limit: int | str | None = "device"
    """Bytes per device, or a size like "80GiB"; None or "none": unlimited; "device": the memory of the
    GPU the profile was measured or estimated for, unlimited for a CPU profile (ranks on one host
    share its memory; give a limit)."""

    optimizer: str | None = None
    """Recount optimizer state for this optimizer (adamw, adam, sgd-momentum, sgd, none); None: the profile's."""

    virtual_stages: int | None = None
    """Chunks per rank v; None: 2 for interleaved1f1b and zbv, else 1. The model is cut into S·v chunks."""

    bandwidth: float | None = DEFAULT_BANDWIDTH
    """Bytes/s between neighbouring ranks; None: communication is free. An engine's measured link
    replaces the default (not a bandwidth given)."""

    boundaries: Sequence[int] | None = None
    """Your own cut: S·v + 1 layer indices from 0 to L; the plan reports the optimum beside it."""

    stage_names: Sequence[Sequence[str]] | None = None
    """Your own cut as layer/module names per chunk (a name covers the layers it prefixes, e.g.
    "transformer.h.0"). Not with ``boundaries``."""

    method: str = "autopipe"
    """"autopipe" (the step-time search), or a baseline: uniform, parameters, type:REGEX, torchtitan, greedy."""

    weight_share: float | None = None
    """Part of the backward that zero-bubble schedules split off as W, in [0, 1]; None: the profile's
    measured split (``Profile.split_backward``), 0.5 where it was not measured."""

    recompute: str = "auto"
    """"none", "full" or "selective": that mode in every chunk; "auto": each chunk the fastest mode
    that fits the memory limit (so none where nothing binds)."""

    dp: int = 1
    """Data-parallel replicas of each stage (the job's ``--dp``); memory is per rank."""

    zero: int | str = 0
    """ZeRO stage 0-3 across those replicas (what each rank shards, autopipe.planner.memory), or
    "auto": the stage whose plan steps fastest under the limit, the lowest on a tie."""

    cuts: Sequence[int] | None = None
    """The only layer indices (1..L-1) a chunk may start at; the plan records them and the step of the
    best unrestricted cut beside its own (``unrestricted_step_time``)."""

    target: str | None = None
    """Plan for an engine that splits by module: torchtitan, megatron, deepspeed or fqns
    (autopipe.planner.targets): only the cuts it allows (with ``cuts``, those of both), and only what
    it runs (its schedules, virtual stages, ZeRO stages)."""

    engine: str | EngineCosts | None = None
    """The engine the job trains on (torch or deepspeed): its measured seconds per op, per send and
    per step (autopipe.costs.engines) join the layers' in the cost model, and its measured P2P
    bandwidth replaces the default link. None, or an engine not measured on the profile's device:
    the layers alone. An ``EngineCosts`` record plans with those figures (what-ifs, the bench that
    fits them)."""

    def __post_init__(self) -> None:
        # Why here: a mistake fails where the options are made, in one line, before any solve; and
        # every re-plan (dataclasses.replace) is checked the same way. In the order partition made them.
        if str(self.schedule).strip().lower() == "auto":  # a choice among plans, made one level up
            raise PartitionError("partition plans one schedule; for schedule='auto' call "
                                 "autopipe.planner.plan_schedules(profile, stages, ...), which plans each and keeps the fastest.")
        for name in ("boundaries", "stage_names", "cuts"):  # the record's, not the caller's list
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))
        object.__setattr__(self, "schedule", normalize_schedule(self.schedule))  # self.v reads the canonical name
        check_schedule(self.schedule, self.stages, self.v, self.m)
        engine_name = self.engine.engine if isinstance(self.engine, EngineCosts) else self.engine
        if engine_name == "torch" and self.schedule == "1f1b" and self.m < self.stages:
            # torch's Schedule1F1B refuses it when the job starts; DeepSpeed's 1F1B and Megatron's run it
            raise PartitionError(f"1f1b on torch's engine needs at least as many micro-batches as stages "
                                 f"({self.m} < {self.stages}): use --microbatches {self.stages} or more, or gpipe.")
        if self.weight_share is not None:
            check_weight_share(self.weight_share)
        if self.recompute not in RECOMPUTE_POLICIES:
            raise PartitionError(f"recompute={self.recompute!r}; use one of {', '.join(RECOMPUTE_POLICIES)}.")
        limit = self.memory_limit
        if limit is not None and not (isinstance(limit, str) and limit.strip().lower() in ("none", "device")):
            parse_size(limit)  # "device" needs the profile: resolve_limit
        zero_choices(self.zero, self.dp)
        if self.boundaries is not None and self.stage_names is not None:
            raise PartitionError("give boundaries or stage_names, not both.")
        if self.target is not None:
            check_target(self.target, schedule=self.schedule, virtual_stages=self.v, dp=self.dp)
            zeros = self.zero_stages
            if len(zeros) == 1:
                check_target(self.target, schedule=self.schedule, virtual_stages=self.v, zero=zeros[0], dp=self.dp)

    @property
    def v(self) -> int:
        """Chunks per rank: ``virtual_stages``, or the schedule's default (2 for interleaved1f1b and zbv)."""
        # `is None`, not `or`: 0 is a mistake to report, not a request for the default.
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.schedule in ("interleaved1f1b", "zbv") else 1

    @property
    def m(self) -> int:
        """Micro-batches per step: ``microbatches``, or 2·S."""
        return self.microbatches if self.microbatches is not None else 2 * max(self.stages, 1)

    @property
    def zero_stages(self) -> list[int]:
        """The ZeRO stages to plan (all four for "auto" with replicas), less those the target cannot run."""
        zeros = zero_choices(self.zero, self.dp)
        if self.target is not None:
            zeros = [z for z in zeros if self.dp == 1 or z in target_info(self.target).zeros] or zeros
        return zeros

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_options(cls, **options: Any) -> PartitionOptions:
        """The record of options held as a mapping (a config, a command's dict): a misspelled name is
        refused in one line naming the closest, where ``PartitionOptions(**options)`` gives a TypeError."""
        for name in options:
            if name not in cls.names():
                near = difflib.get_close_matches(name, cls.names(), n=1)
                hint = f"did you mean {near[0]!r}?" if near else f"use one of {', '.join(cls.names())}."
                raise PartitionError(f"unknown partition option {name!r}; {hint}")
        if "stages" not in options:
            raise PartitionError("partition options need stages (the pipeline ranks).")
        return cls(**options)

    @classmethod
    def of_plan(cls, plan: Plan) -> PartitionOptions:
        """The options of the job ``plan`` was made for, not of how it was cut: its stages, micro-batches,
        schedule, virtual stages, memory limit (in bytes), link, weight share, optimizer, recompute
        and ZeRO policies, replicas and engine; method autopipe, no boundaries, cuts nor target.
        What ``compare_baselines`` plans each baseline with."""
        return cls(
            plan.stages, microbatches=plan.microbatches, schedule=plan.schedule, memory_limit=plan.memory_limit,
            virtual_stages=plan.virtual_stages, bandwidth=None if plan.bandwidth == float("inf") else plan.bandwidth,
            weight_share=plan.weight_share, optimizer=plan.optimizer, recompute=plan.recompute, dp=plan.dp,
            zero="auto" if plan.zero_policy == "auto" else plan.zero, engine=plan.engine or None,
        )  # fmt: skip


def zero_choices(zero: int | str, dp: int) -> list[int]:
    """The ZeRO stages to try: the one given, or all four for "auto" (only 0 without replicas)."""
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise PartitionError(f"dp={dp!r}: the data-parallel replicas must be a whole number >= 1.")
    if isinstance(zero, str) and zero.strip().lower() == "auto":
        return [0] if dp == 1 else list(ZERO_STAGES)
    try:
        z = int(zero)
    except (TypeError, ValueError):
        z = -1
    if z not in ZERO_STAGES or isinstance(zero, bool) or (isinstance(zero, float) and zero != z):
        raise PartitionError(f"zero={zero!r}; use a ZeRO stage 0, 1, 2 or 3, or 'auto'.")
    return [z]
