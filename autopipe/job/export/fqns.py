"""Any other engine: the plan's module names per stage as JSON, with where each stage runs.

Example:
    >>> from autopipe.job.export.modules import StageModules
    >>> sm = StageModules("fqns", "m", 2, 1, "1f1b", 4, 1, 1, 0, "none", (0, 1), ((0, 2), (2, 3)), (("a", "b"), ("c",)))
    >>> fqns_dict(sm)["stages"][1]
    {'stage': 1, 'rank': 1, 'modules': ['c'], 'layers': [2, 3]}
"""

from __future__ import annotations

import json
from typing import Any

from .modules import StageModules

__all__ = ["fqns_dict", "fqns_json"]


def fqns_dict(sm: StageModules) -> dict[str, Any]:
    """The record: per stage (virtual stages in model order) its rank, modules and flattened layers."""
    return {
        "kind": "autopipe.fqns",
        "model": sm.model,
        "pipeline_ranks": sm.stages,
        "virtual_stages": sm.virtual_stages,
        "schedule": sm.schedule,
        "microbatches": sm.microbatches,
        "microbatch_size": sm.microbatch_size,
        "data_parallel": sm.dp,
        "zero": sm.zero,
        "recompute": sm.recompute,
        "predicted_step_seconds": sm.step_time,
        "stages": [{"stage": c, "rank": r, "modules": list(m), "layers": list(ab)}
                   for c, (m, r, ab) in enumerate(zip(sm.modules, sm.chunk_ranks, sm.layers))],
        "every_stage": list(sm.every_stage),
        "tied": [{"tensors": list(names), "stages": list(chunks)} for names, chunks in sm.tied],
    }


def fqns_json(sm: StageModules) -> str:
    return json.dumps(fqns_dict(sm), indent=1) + "\n"
