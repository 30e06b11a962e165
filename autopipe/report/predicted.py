"""The predicted step in words: the one figure, and what it is made of, as every place shows it.

convert's summary line, the job's README, report.html's cards and the step log (its ``plan N``)
show one number for a plan's step, ``Plan.predicted_step``, in the same words; with a noisy
profile behind it, they say so beside it (``Plan.profile_noise``, judged by autopipe.costs.noise).
Before this module they showed three figures for one plan: the dedicated simulation, the shared-core
one and the whole step (issue 41).

Example:
    >>> from dataclasses import replace
    >>> from autopipe.costs.layer_costs import Profile
    >>> from autopipe.planner import partition
    >>> plan = partition(Profile.from_costs([1.0, 1.0, 1.0, 1.0]), 2, microbatches=4)
    >>> step_figure(plan), step_parts(plan)
    ('10 s', 'simulated 1f1b, 4 micro-batches')
    >>> step_text(replace(plan, profile_noise="runs spread 35%"))
    '10 s (simulated 1f1b, 4 micro-batches; noisy profile: runs spread 35%)'
"""

from __future__ import annotations

from ..costs.noise import noisy_phrase
from ..planner.plan import Plan
from ..units import format_time

__all__ = ["step_figure", "step_parts", "step_text"]


def step_figure(plan: Plan) -> str:
    """``plan.predicted_step`` as every place prints it (``format_time``: three digits)."""
    return format_time(plan.predicted_step)


def step_parts(plan: Plan) -> str:
    """What the predicted step counts: the schedule simulated (on the cores the ranks share, where
    they outnumber them), and on an engine what follows the schedule (norm, optimizer step)."""
    words = f"simulated {plan.schedule}, {plan.microbatches} micro-batches"
    if plan.shared_step_time is not None and plan.cores:
        words += f", {plan.world} ranks sharing {plan.cores} CPU cores"
    after = plan.predicted_step - plan.schedule_step_time
    if plan.engine and after > 0:
        words += f", on {plan.engine}: the schedule {format_time(plan.schedule_step_time)}, then norm and optimizer {format_time(after)}"
    return words


def step_text(plan: Plan) -> str:
    """The figure with what it counts and, after a noisy profile, the words that say so."""
    noisy = noisy_phrase(plan.profile_noise)
    return f"{step_figure(plan)} ({step_parts(plan)}{'; ' + noisy if noisy else ''})"
