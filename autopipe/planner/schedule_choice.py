"""Which schedule a job runs: every schedule's own best plan, and ``auto`` = the simplest of the fastest. No torch.

A plan is made for one schedule (``partition(..., schedule=...)``): the cut that minimises that
schedule's simulated step, with the memory it keeps in flight. :func:`plan_schedules` makes every
schedule's plan under the same options and keeps the simplest one, in the order of
:data:`SCHEDULE_PREFERENCE` (fewer chunks per rank, fewer micro-batches held, fewer sends), whose
whole step (``plan.total_step_time``) is within :data:`SCHEDULE_MARGIN` of the least. A schedule is
left out, with its one-line reason, when the engine or the ``--for`` target does not run it
(DeepSpeed's pipeline engine runs its own 1F1B only), when one stage leaves no bubble to fill, or
when its plan cannot be made (too few layers for S·v chunks, micro-batches its rule refuses, no cut
that fits the memory limit).

One chunk per stage can always be cut when any plan can, so ``auto`` refuses only what 1F1B
refuses, and with 1F1B's own message.

Example:
    >>> from autopipe.costs.layer_costs import Profile
    >>> choice = plan_schedules(Profile.from_costs([1, 1, 1, 1]), 2, bandwidth=None)
    >>> choice.schedule, [s for s, _ in choice.plans]
    ('zbv', ['1f1b', 'gpipe', 'interleaved1f1b', 'zbv'])
    >>> plan_schedules(Profile.from_costs([1, 2]), 2, bandwidth=None).skipped[0]
    ('interleaved1f1b', 'cannot cut 2 layers into 4 non-empty chunks (2 stages x 2 virtual); use at most 1 stages')
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from ..costs.layer_costs import Profile
from ..errors import ExportError, InfeasibleMemoryError, PartitionError
from ..units import format_time
from .plan import Plan
from .schedules import SCHEDULES, normalize_schedule
from .step_solver import TIE
from .targets import target_info

__all__ = ["ScheduleChoice", "plan_schedules", "schedules_for", "is_auto", "SCHEDULE_PREFERENCE", "SCHEDULE_MARGIN",
           "ENGINE_SCHEDULES"]

# The order a tie goes by: one chunk per rank before two (fewer sends, one module per rank), 1F1B
# before GPipe (at most S micro-batches in flight, not M), interleaved before zbv (no deferred
# weight gradients held).
SCHEDULE_PREFERENCE = ("1f1b", "gpipe", "interleaved1f1b", "zbv")
assert sorted(SCHEDULE_PREFERENCE) == sorted(SCHEDULES)

# How much faster a less simple schedule must be planned to be chosen over a simpler one, as a
# fraction of the fastest plan's whole step. Step predictions hold within ±5% of measured jobs, and
# two schedules planned from one profile 2-3% apart ran 1-2% apart either way (Llama and GPT-2, 4
# stages, bench/results/peers-4*.md): inside that, the simpler schedule (fewer sends, fewer chunks
# and micro-batches held) is the safer bet; 0 keeps the least predicted step.
SCHEDULE_MARGIN = 0.03

# What each engine runs. DeepSpeed's pipeline engine always runs its own TrainSchedule (1F1B):
# autopipe's DeepSpeed runtime accepts --schedule gpipe but runs that same 1F1B, so a gpipe plan
# there would predict GPipe's memory and step for a run that is not GPipe.
ENGINE_SCHEDULES = {"torch": SCHEDULES, "deepspeed": ("1f1b",)}


def is_auto(schedule: str | None) -> bool:
    """Whether ``schedule`` asks for the choice (``auto``) rather than naming one."""
    return schedule is not None and str(schedule).strip().lower() == "auto"


@dataclass(frozen=True)
class ScheduleChoice:
    """Each schedule's best plan under the same options, the schedules skipped (with why), the one
    chosen (the simplest within ``margin`` of the fastest)."""

    schedule: str
    plans: tuple[tuple[str, Plan], ...]
    skipped: tuple[tuple[str, str], ...]
    margin: float = 0.0

    @property
    def plan(self) -> Plan:
        return dict(self.plans)[self.schedule]

    @property
    def steps(self) -> dict[str, float]:
        """Each planned schedule's predicted whole step, seconds."""
        return {s: p.total_step_time for s, p in self.plans}

    @property
    def why(self) -> str:
        """One line: what was chosen and why."""
        steps = ", ".join(f"{s} {format_time(p.total_step_time)}" for s, p in self.plans)
        out = f"schedule {self.schedule}: predicted whole step {steps}"
        fastest, best = min(self.plans, key=lambda sp: sp[1].total_step_time)
        over = self.plan.total_step_time / best.total_step_time - 1
        if over > TIE:  # the margin decided (an exact tie went to the simpler schedule by the order alone)
            out += (f"; the simpler {self.schedule} kept: planned {over:.1%} over {fastest},"
                    f" within the {self.margin:.0%} margin (the predictions' noise)")
        reasons: dict[str, list[str]] = {}  # schedules left out for the same reason, named together
        for s, why in self.skipped:
            reasons.setdefault(why, []).append(s)
        for why, names in reasons.items():
            out += f"; {', '.join(names)} not considered: {why}"
        return out

    def to_dict(self) -> dict[str, Any]:
        """What `plan --json` prints: the choice, each schedule's plan, each skipped one's reason."""
        return {"chosen": self.schedule, "margin": self.margin, "plans": {s: p.to_dict() for s, p in self.plans},
                "skipped": dict(self.skipped)}


def schedules_for(engine: str | None = None, target: str | None = None,
                  stages: int = 2) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:  # fmt: skip
    """The schedules worth planning for ``engine`` (None: the layers alone, any schedule) and
    ``target``, in preference order, and those left out with why.

    >>> schedules_for("deepspeed")[0], schedules_for(target="megatron")[1][0]
    (('1f1b',), ('gpipe', 'Megatron-Core has no gpipe schedule'))
    """
    runs = ENGINE_SCHEDULES.get(engine or "torch", SCHEDULES)
    keep: list[str] = []
    skipped: list[tuple[str, str]] = []
    for s in SCHEDULE_PREFERENCE:
        if s not in runs:
            skipped.append((s, "DeepSpeed's pipeline engine runs its own 1F1B"))
        elif target is not None and s not in target_info(target).schedules:
            skipped.append((s, f"{target_info(target).name} has no {s} schedule"))
        elif stages == 1 and s != "1f1b":
            skipped.append((s, "one stage runs the same chain under every schedule"))
        else:
            keep.append(s)
    return tuple(keep), tuple(skipped)


def plan_schedules(profile: Profile, stages: int, *, engine: str | None = None, target: str | None = None,
                   schedules: Sequence[str] | None = None, margin: float = SCHEDULE_MARGIN,
                   **options: Any) -> ScheduleChoice:  # fmt: skip
    """Every schedule's best plan for ``partition(profile, stages, **options)`` and the one to run:
    the simplest whose whole step is within ``margin`` of the fastest.

    Args:
        profile, stages: as for ``partition``.
        engine, target: passed to ``partition``; they also decide which schedules run at all.
        schedules: plan only these (default: all four); the others are skipped.
        margin: a schedule later in :data:`SCHEDULE_PREFERENCE` is chosen only when planned faster
            than every earlier one by more than this fraction of the fastest step (0: the least
            predicted step, the simpler schedule on an exact tie).
        **options: ``partition``'s other options, the same for every schedule (``virtual_stages``
            given applies to each: only the schedules that run that many chunks per rank remain).

    The chosen plan (and every candidate's) records the choice: ``schedule_policy="auto"``,
    ``schedule_steps``, ``schedule_skipped`` and ``schedule_margin``. Raises the first refusal (1F1B's, where it was
    planned) when no schedule's plan can be made.
    """
    from .partitioner import partition

    if "schedule" in options:
        raise PartitionError("plan_schedules chooses the schedule; give partition(schedule=...) for one schedule.")
    if not 0 <= margin < 1:
        raise PartitionError(f"schedule margin {margin!r} is not a fraction in [0, 1); e.g. 0.03 for 3%.")
    keep, skipped_list = schedules_for(engine, target, stages)
    skipped = list(skipped_list)
    if schedules is not None:
        wanted = {normalize_schedule(s) for s in schedules}
        skipped += [(s, "not asked for") for s in keep if s not in wanted]
        keep = tuple(s for s in keep if s in wanted)
    plans: list[tuple[str, Plan]] = []
    first: PartitionError | ExportError | None = None
    for s in keep:
        try:
            plans.append((s, partition(profile, stages, schedule=s, engine=engine, target=target, **options)))
        except (PartitionError, ExportError) as e:  # this schedule cannot be made; another may
            first = first or e
            skipped.append((s, _reason(e)))
    if not plans:
        if first is not None:
            raise first
        raise PartitionError("no schedule can run these options: " + "; ".join(f"{s}: {w}" for s, w in skipped) + ".")
    best = min(p.total_step_time for _, p in plans)
    # plans are in preference order: the first within the margin (and the tie's last bits) of the fastest
    chosen = next(s for s, p in plans if p.total_step_time <= best * (1 + margin) * (1 + TIE))
    order = {s: i for i, s in enumerate(SCHEDULE_PREFERENCE)}
    skipped.sort(key=lambda sw: order[sw[0]])
    steps = {s: p.total_step_time for s, p in plans}
    record = dict(schedule_policy="auto", schedule_steps=steps, schedule_skipped=dict(skipped), schedule_margin=margin)
    return ScheduleChoice(chosen, tuple((s, replace(p, **record)) for s, p in plans), tuple(skipped), margin)


def _reason(error: Exception) -> str:
    """The refusal in a phrase: a memory refusal's head (what did not fit; its hints are for one schedule)."""
    line = (str(error).splitlines()[0] if str(error) else type(error).__name__).rstrip(".")
    if isinstance(error, InfeasibleMemoryError) and ": " in line:
        head, _, rest = line.partition(": ")
        if head.endswith("allows fits"):  # a restricted cut's refusal wraps the limit's (targets.explain_restricted)
            head += ": " + rest.partition(": ")[0]
        return head
    return line
