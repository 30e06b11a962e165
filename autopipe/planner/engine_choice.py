"""Which engine a job trains on: each engine's own best plan, and ``auto`` = the fastest that can run. No torch.

A plan is made for one engine (``partition(..., engine=...)``): the cut is the best for that
engine's measured overheads (autopipe.costs.engines), and its predicted whole step is
``plan.total_step_time``. :func:`plan_engines` makes every engine's plan under the same options;
an engine that cannot run them (DeepSpeed's pipeline runs its own 1F1B or GPipe-like order, bf16 or
fp32, ZeRO 0/1, no per-stage recompute; it must be importable) is skipped with the reason, and
``EngineChoice.engine`` is the fastest of the rest (torch on a tie: on a device with no measured
engine costs both predict the layers alone). With ``schedule="auto"`` each engine's plan is the best
of the schedules it runs (planner.schedule_choice): every engine x schedule pair is planned, and
``EngineChoice.schedules`` keeps each engine's choice.

Example:
    >>> from autopipe.costs.layer_costs import Profile
    >>> choice = plan_engines(Profile.from_costs([1, 2, 2, 1]), 2, bandwidth=None, importable=lambda name: False)
    >>> choice.engine, choice.skipped
    ('torch', (('deepspeed', 'deepspeed is not installed (pip install deepspeed)'),))
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

from ..choices import ENGINES
from ..costs.layer_costs import Profile
from ..errors import InfeasibleMemoryError, PartitionError
from .plan import Plan
from .schedule_choice import ScheduleChoice, is_auto, plan_schedules
from .schedules import normalize_schedule

__all__ = ["EngineChoice", "plan_engines", "deepspeed_refusal", "DEEPSPEED_SCHEDULES"]

# What DeepSpeed's pipeline engine runs: its own 1F1B (GPipe-like when asked), ZeRO 0 or 1.
DEEPSPEED_SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class EngineChoice:
    """Each engine's best plan under the same options, the engines skipped (with why), the fastest."""

    engine: str
    plans: tuple[tuple[str, Plan], ...]
    skipped: tuple[tuple[str, str], ...]
    schedules: tuple[tuple[str, ScheduleChoice], ...] = ()  # with schedule "auto": each engine's schedule choice

    @property
    def plan(self) -> Plan:
        return dict(self.plans)[self.engine]

    @property
    def schedule_choice(self) -> ScheduleChoice | None:
        """The chosen engine's schedule choice (schedule "auto"), else None."""
        return dict(self.schedules).get(self.engine)

    @property
    def why(self) -> str:
        """One line: what was chosen and why (each engine's schedule beside its step when auto chose it)."""
        chose = dict(self.schedules)
        steps = ", ".join(f"{e} {p.total_step_time:.3f} s" + (f" ({p.schedule})" if e in chose else "")
                          for e, p in self.plans)  # fmt: skip
        out = f"engine {self.engine}: predicted whole step {steps}"
        if self.skipped:
            out += "; " + "; ".join(f"{e} not considered: {why}" for e, why in self.skipped)
        return out


def deepspeed_refusal(*, schedule: str, dtype: str = "fp32", recompute: str = "none", zero: int | str = 0) -> str | None:
    """Why DeepSpeed's pipeline engine cannot run these options, or None when it can.

    >>> deepspeed_refusal(schedule="zbv")
    '--schedule zbv does not run on --engine deepspeed (its own 1F1B schedule; bf16 or fp32)'
    """
    if schedule not in DEEPSPEED_SCHEDULES or dtype == "fp16":
        what = f"--schedule {schedule}" if schedule not in DEEPSPEED_SCHEDULES else "--dtype fp16"
        return f"{what} does not run on --engine deepspeed (its own 1F1B schedule; bf16 or fp32)"
    if recompute in ("selective", "full"):
        return f"--recompute {recompute} does not run on --engine deepspeed (set activation checkpointing in its ds_config.json)"
    if zero == "auto" or int(zero) > 1:
        return f"--zero {zero} does not run on --engine deepspeed (its pipeline engine has ZeRO 0 and 1 only)"
    return None


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def plan_engines(profile: Profile, stages: int, *, engines: tuple[str, ...] = ENGINES, dtype: str = "fp32",
                 importable: Callable[[str], bool] = _importable, **options: Any) -> EngineChoice:  # fmt: skip
    """Every engine's best plan for ``partition(profile, stages, **options)`` and the fastest.

    DeepSpeed plans without recompute (its engine applies none the plan asks for); an engine that
    cannot run the options is skipped with its reason. ``schedule="auto"``: each engine's plan is its
    best schedule's (``plan_schedules``). Raises PartitionError when no engine can."""
    from .partitioner import partition

    auto = is_auto(options.get("schedule"))
    plans, skipped, schedules = [], [], []
    for engine in engines:
        opts = dict(options)
        if engine == "deepspeed":
            why = None if importable("deepspeed") else "deepspeed is not installed (pip install deepspeed)"
            asked = "1f1b" if auto else normalize_schedule(str(opts.get("schedule", "1f1b")))  # auto: its own 1F1B
            why = why or deepspeed_refusal(schedule=asked, dtype=dtype, recompute=str(opts.get("recompute", "auto")),
                                           zero=opts.get("zero", 0))  # fmt: skip
            if why:
                skipped.append((engine, why))
                continue
            opts["recompute"] = "none"
        try:
            if auto:
                del opts["schedule"]
                sc = plan_schedules(profile, stages, engine=engine, **opts)
                plans.append((engine, sc.plan))
                schedules.append((engine, sc))
            else:
                plans.append((engine, partition(profile, stages, engine=engine, **opts)))
        except InfeasibleMemoryError as e:  # another engine may fit (torch recomputes, DeepSpeed does not)
            skipped.append((engine, str(e).splitlines()[0]))
    if not plans:
        raise PartitionError("no engine can run these options: " + "; ".join(why for _, why in skipped) + ".")
    best = min(plans, key=lambda ep: ep[1].total_step_time)  # the first (torch) on a tie
    return EngineChoice(best[0], tuple(plans), tuple(skipped), tuple(schedules))
