"""The partition pass: Profile + stages + schedule + memory limit -> Plan. No torch.

    partitioner  partition: the cut with the shortest simulated step under the memory limit
    options      PartitionOptions: every option partition takes, as one checked record
    plan         Plan: the record of a cut and what it predicts
    schedules    the schedules (GPipe, 1F1B, interleaved, zbv): step time, bubble, timeline
    simulator    how the simulator runs a fixed op order
    step_solver  the step-time partitioner (the algorithm)
    step_bound   its lower bound: no cut steps faster
    chunk_costs  what any chunk of layers costs, in O(1) from prefix sums
    memory       what a pipeline rank holds at its peak, term by term
    schedule_choice  schedule "auto": every schedule's plan, the fastest kept
    baselines    the partitioners users know (uniform, parameters, type:, torchtitan, greedy)
    bottleneck   the exact bottleneck solver the parameter and type: baselines use
"""

from __future__ import annotations

from .options import PartitionOptions
from .partitioner import (
           DEFAULT_BANDWIDTH,
           compare_baselines,
           fits_memory,
           partition,
           resolve_limit,
)
from .plan import Plan
from .schedule_choice import ScheduleChoice, plan_schedules
from .schedules import SCHEDULES, Simulation, normalize_schedule, simulate

__all__ = ["DEFAULT_BANDWIDTH", "Plan", "SCHEDULES", "Simulation", "compare_baselines", "fits_memory",
           "normalize_schedule", "partition", "PartitionOptions", "plan_schedules", "resolve_limit", "ScheduleChoice", "simulate"]
