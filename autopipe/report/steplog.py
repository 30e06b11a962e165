"""A training run's step log (``train.py --log-json``) read back and set beside its plan's predictions.

The plan predicts a step time (its whole step, ``Plan.predicted_step``) and each pipeline rank's
peak memory; the step log measures both every step (the whole step as ``whole_step_time``; a log
written before that field has the schedule's ``step_time`` only, which then stands in). ``compare`` reduces a log to what a prediction is judged by: the median
step time and each rank's largest peak, over the steps after warm-up (the first step also pays
for the schedule's shape exchange and the optimizer's state allocation), with the spread of the
step times so a person can see how noisy the machine was.

Example (a log of 3 steps, as ``train.py --log-json log.json`` writes it, for a plan of 2 ranks):
    >>> import json
    >>> from autopipe.costs.layer_costs import Profile
    >>> from autopipe.planner import partition
    >>> plan = partition(Profile.from_costs([0.01, 0.04, 0.04, 0.03], param_bytes=[4 << 20, 8 << 20, 8 << 20, 4 << 20]),
    ...                  2, microbatches=4)
    >>> round(plan.predicted_step, 2), [m >> 20 for m in plan.rank_memory]  # seconds; MiB per rank
    (0.33, [48, 48])
    >>> steps = [(1, 0.9, [30, 30]), (2, 0.34, [49, 46]), (3, 0.345, [47.5, 46.6])]  # seconds, MiB per rank
    >>> with open("log.json", "w") as f:
    ...     for step, seconds, mib in steps:
    ...         peaks = [int(m * 2**20) for m in mib]
    ...         print(json.dumps({"step": step, "step_time": seconds, "peak_memory": peaks}), file=f)
    >>> cmp = compare(plan, read_step_log("log.json"))  # step 1 is warm-up: left out
    >>> round(cmp.step_ratio, 2), [round(r, 2) for r in cmp.memory_ratios]
    (1.04, [1.02, 0.97])
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RecordError
from ..planner.plan import Plan

__all__ = ["Comparison", "compare", "read_step_log"]


def read_step_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON lines of a step log, in order; a clear error for a missing or malformed file."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except FileNotFoundError:
        raise RecordError(f"no step log at {p}; train with --log-json {p}.") from None
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise RecordError(f"{p}:{i} is not a JSON line ({e}).") from None
        if not isinstance(rec, dict) or "step" not in rec or "step_time" not in rec:
            raise RecordError(f"{p}:{i} is not a step record (no 'step'/'step_time'); pass a train.py --log-json file.")
        records.append(rec)
    if not records:
        raise RecordError(f"{p} holds no steps.")
    return records


@dataclass(frozen=True)
class Comparison:
    """Predicted against measured, for one plan and one run."""

    steps: int  # steps the figures are taken over (after warm-up)
    predicted_step_time: float
    measured_step_time: float  # median
    step_time_spread: float  # interquartile range of the measured step times
    predicted_memory: tuple[int, ...]  # per pipeline rank
    measured_memory: tuple[int, ...]  # per pipeline rank: the largest peak over those steps

    @property
    def step_ratio(self) -> float:
        """measured / predicted step time (1.0: exact; > 1: the run is slower than the plan said)."""
        return self.measured_step_time / self.predicted_step_time if self.predicted_step_time > 0 else float("nan")

    @property
    def memory_ratios(self) -> tuple[float, ...]:
        """measured / predicted peak per rank (nan where nothing comparable was measured)."""
        return tuple(m / p if p > 0 and m > 0 else float("nan") for m, p in zip(self.measured_memory, self.predicted_memory))


def compare(plan: Plan, records: list[dict[str, Any]], *, warmup: int = 1) -> Comparison:
    """The plan's predictions against a step log, skipping the first ``warmup`` steps (when the log
    has more). Per-rank peaks are the maximum over the kept steps: the plan promises a ceiling; 0
    where the run did not measure what the plan counts (a CPU job without ``--exact-memory``)."""
    kept = records[warmup:] if len(records) > warmup else records
    # the whole step, as StepStats.whole_step takes it: never under the slowest rank's schedule
    times = [max(float(r.get("whole_step_time") or 0.0), float(r["step_time"])) for r in kept]
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    ranks = len(plan.rank_memory)
    peaks = [0] * ranks
    for r in kept:
        if r.get("memory_exact") is False:  # a CPU heap's resident peak, not the tensors the plan counts
            continue
        for i, m in enumerate((r.get("peak_memory") or [])[:ranks]):
            peaks[i] = max(peaks[i], int(m))
    return Comparison(
        steps=len(kept),
        predicted_step_time=plan.predicted_step,
        measured_step_time=statistics.median(times),
        step_time_spread=q[2] - q[0],
        predicted_memory=tuple(int(m) for m in plan.rank_memory),
        measured_memory=tuple(peaks),
    )
