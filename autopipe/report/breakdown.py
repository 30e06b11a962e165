"""Where a measured step went, part by part, beside the plan's own terms.

``bench/bench_peers.py`` runs a job (and the bare scripts it is compared with) with the steps after
warm-up under torch's profiler, ranges put around each part of a step, and writes, per method, each
pipeline rank's seconds per step in each part (forward, backward, P2P, optimizer, gradient
norm/clip, tied and data-parallel reduces, data, statistics and memory reads) and the whole step.
``autopipe report PLAN --breakdown FILE`` shows them beside what the plan charges each rank: its
chunks' forward and backward compute and their sends, times the micro-batches. The plan has no
term for the optimizer, the norm or the reads: what they take is what it leaves out.

Example (doctests run in a temporary folder):
    >>> import json
    >>> from autopipe.costs.layer_costs import Profile
    >>> from autopipe.planner import partition
    >>> plan = partition(Profile.from_costs([0.01, 0.04, 0.04, 0.03]), stages=2, microbatches=4)
    >>> [{k: round(v, 2) for k, v in t.items()} for t in plan_terms(plan)][0]["step"] == round(plan.step_time, 2)
    True
    >>> with open("breakdown.json", "w") as f:
    ...     _ = f.write(json.dumps([{"method": "job", "ranks": [{"forward": 0.05, "step": 0.4}, {"forward": 0.06, "step": 0.4}]}]))
    >>> b = read_breakdowns("breakdown.json")
    >>> b[0].method, b[0].ranks[1]["forward"]
    ('job', 0.06)
    >>> breakdown_table(plan, b).count("<tr>")  # a header, 2 measured ranks, 2 of the plan
    5
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import AutopipeError
from ..planner.plan import Plan
from ..units import format_time

__all__ = ["PLAN_PARTS", "StepBreakdown", "breakdown_table", "plan_terms", "read_breakdowns"]

PLAN_PARTS = ("forward", "backward", "p2p")  # what the plan charges each rank; the rest it leaves out


@dataclass(frozen=True)
class StepBreakdown:
    """One method's measured step: per pipeline rank, seconds per step of each part and of the whole
    ("step")."""

    method: str
    ranks: tuple[dict[str, float], ...]


def read_breakdowns(path: str | os.PathLike[str]) -> list[StepBreakdown]:
    """The breakdowns a bench wrote: a JSON list of ``{"method": ..., "ranks": [{part: seconds}, ...]}``."""
    try:
        data = json.loads(open(path).read())
        out = [StepBreakdown(str(d["method"]), tuple({str(k): float(v) for k, v in r.items()} for r in d["ranks"]))
               for d in data]  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise AutopipeError(f"{path} is not a step breakdown (a JSON list of {{method, ranks}}, as bench/bench_peers.py "
                            f"writes): {e}") from None  # fmt: skip
    if not out:
        raise AutopipeError(f"{path} holds no step breakdown.")
    return out


def plan_terms(plan: Plan) -> list[dict[str, float]]:
    """What the plan charges each rank per step: its chunks' forward, backward and sends (both
    directions), each times the micro-batches, and the simulated step."""
    m = plan.microbatches
    ranks = max(plan.stage_ranks, default=0) + 1
    terms = [{"forward": 0.0, "backward": 0.0, "p2p": 0.0, "step": plan.step_time} for _ in range(ranks)]
    for c, r in enumerate(plan.stage_ranks):
        terms[r]["forward"] += plan.stage_forward[c] * m
        terms[r]["backward"] += plan.stage_backward[c] * m
        terms[r]["p2p"] += 2 * plan.stage_comm[c] * m
    return terms


def breakdown_table(plan: Plan, breakdowns: list[StepBreakdown]) -> str:
    """An HTML table: a row per method and rank, a column per part, the plan's rows last."""
    parts = list(PLAN_PARTS)
    for b in breakdowns:
        for r in b.ranks:
            parts += [k for k in r if k not in parts and k != "step"]
    rows = []

    def row(label: str, rank: int, values: dict[str, float]) -> str:
        cells = "".join(f"<td>{format_time(values[p]) if p in values else ''}</td>" for p in parts)
        rest = values.get("step", 0.0) - sum(values.get(p, 0.0) for p in parts)
        return (f"<tr><td class=\"l\">{label}</td><td>{rank}</td>{cells}<td>{format_time(max(rest, 0.0))}</td>"
                f"<td>{format_time(values.get('step', 0.0))}</td></tr>")  # fmt: skip

    for b in breakdowns:
        rows += [row(b.method, r, values) for r, values in enumerate(b.ranks)]
    rows += [row("plan", r, t) for r, t in enumerate(plan_terms(plan))]
    head = "<tr><th class=\"l\">method</th><th>rank</th>" + "".join(f"<th>{p}</th>" for p in parts) + "<th>other</th><th>step</th></tr>"
    return f"<table class=\"measured\">{head}{''.join(rows)}</table>"
