"""Which layers each pipeline chunk holds and which pipeline rank runs it.

A plan cuts the layer sequence into C = S·v chunks (S pipeline ranks, v virtual stages each).
Looped schedules (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble) give chunk c to rank c % S;
V-shaped ones (ZBVZeroBubble, DualPipeV) go down and back up: rank r holds chunks r and 2S-1-r, so
the first and the last chunk sit on rank 0. torch.distributed.pipelining makes the same choice
(``generate_stage_to_rank_mapping``); we compute it here because every rank must know every
chunk's owner before any schedule exists (to materialise parameters and build tied groups).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..choices import PLACEMENTS
from ..errors import PartitionError, RecordError

__all__ = ["SCHEDULES", "ChunkLayout", "even_boundaries", "load_plan", "plan_placement", "schedule_name", "schedule_style"]

# Canonical names of the schedules torch.distributed.pipelining provides, lower-case key -> name.
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved1f1b": "Interleaved1F1B",
    "loopedbfs": "LoopedBFS",
    "interleavedzerobubble": "InterleavedZeroBubble",
    "zbvzerobubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
    # the partitioner's spellings (autopipe.planner.schedules)
    "interleaved": "Interleaved1F1B",
    "zbv": "ZBVZeroBubble",
    "zerobubble": "ZBVZeroBubble",
    "interleavedzb": "InterleavedZeroBubble",
}
_SINGLE = {"GPipe", "1F1B"}  # one chunk per rank
_V_SHAPED = {"ZBVZeroBubble", "DualPipeV"}  # exactly two chunks per rank, V-shaped


def schedule_name(name: str) -> str:
    """The canonical spelling of a schedule name (case and '-'/'_' ignored)."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in SCHEDULES:
        raise PartitionError(
            f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES.values())}."
        )
    return SCHEDULES[key]


def even_boundaries(num_layers: int, chunks: int) -> list[int]:
    """Cut ``num_layers`` into ``chunks`` runs of (nearly) equal length, longer ones first.

    Example:
        >>> even_boundaries(7, 3)
        [0, 3, 5, 7]
    """
    if not 1 <= chunks <= num_layers:
        raise PartitionError(f"cannot cut {num_layers} layers into {chunks} chunks of at least one layer.")
    base, extra = divmod(num_layers, chunks)
    cuts = [0]
    for c in range(chunks):
        cuts.append(cuts[-1] + base + (1 if c < extra else 0))
    return cuts


def schedule_style(name: str) -> str:
    """``"v"`` for V-shaped schedules, ``"loop"`` for the others."""
    return "v" if schedule_name(name) in _V_SHAPED else "loop"


@dataclass(frozen=True)
class ChunkLayout:
    """Chunks of consecutive layers and their owner ranks.

    Example:
        >>> lay = ChunkLayout.make([0, 2, 4, 5, 6], pp_size=2, schedule="Interleaved1F1B")
        >>> lay.chunks_of(1), lay.layers_of(3)
        ([1, 3], range(5, 6))
    """

    boundaries: tuple[int, ...]  # C + 1 layer indices from 0 to L
    pp_size: int
    schedule: str  # canonical schedule name

    @classmethod
    def make(cls, boundaries: Sequence[int] | Any, *, pp_size: int, schedule: str) -> ChunkLayout:
        """Check the boundaries (or ``plan.boundaries``) fit ``pp_size`` ranks and the schedule."""
        plan_ranks = tuple(getattr(boundaries, "stage_ranks", ()) or ())
        cuts = tuple(int(b) for b in getattr(boundaries, "boundaries", boundaries))
        name = schedule_name(schedule)
        chunks = len(cuts) - 1
        if chunks < 1 or any(b <= a for a, b in itertools.pairwise(cuts)):
            raise PartitionError(f"boundaries {list(cuts)} must be strictly increasing from 0.")
        if pp_size == 1:  # one process runs every chunk, as one stage
            return cls(cuts, 1, name)
        if chunks % pp_size:
            raise PartitionError(
                f"{chunks} chunks cannot be spread evenly over {pp_size} pipeline ranks; "
                f"make a plan with a multiple of {pp_size} stages (stages x virtual stages)."
            )
        per_rank = chunks // pp_size
        if name in _SINGLE and per_rank != 1 and pp_size > 1:
            raise PartitionError(
                f"{name} runs one chunk per rank but the plan has {per_rank} per rank; "
                "use Interleaved1F1B (or InterleavedZeroBubble) for virtual stages."
            )
        if name in _V_SHAPED and per_rank != 2:
            raise PartitionError(
                f"{name} needs exactly 2 chunks per rank, the plan has {per_rank}; "
                "partition with virtual_stages=2."
            )
        layout = cls(cuts, pp_size, name)
        if plan_ranks and pp_size > 1:
            mine = tuple(layout.owner(c) for c in range(chunks))
            if mine != plan_ranks:
                raise PartitionError(
                    f"the plan places chunks on ranks {list(plan_ranks)} but {name} runs them on "
                    f"{list(mine)}; make the plan for schedule {name} (or run the plan's own schedule)."
                )
        return layout

    @property
    def num_chunks(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        return self.boundaries[-1]

    @property
    def multi(self) -> bool:
        """Whether the schedule is a multi-chunk (PipelineScheduleMulti) one."""
        return self.schedule not in _SINGLE

    def owner(self, chunk: int) -> int:
        """The pipeline rank that runs ``chunk``."""
        s = self.pp_size
        if s == 1:  # one process runs every chunk (plain `python train.py`), V-shaped ones too
            return 0
        if self.schedule in _V_SHAPED:
            return chunk if chunk < s else 2 * s - 1 - chunk
        return chunk % s

    def chunks_of(self, pp_rank: int) -> list[int]:
        """The chunks ``pp_rank`` runs, in pipeline order."""
        return [c for c in range(self.num_chunks) if self.owner(c) == pp_rank]

    def layers_of(self, chunk: int) -> range:
        return range(self.boundaries[chunk], self.boundaries[chunk + 1])

    def ranks_holding(self, layers: Sequence[int]) -> list[int]:
        """Sorted pipeline ranks whose chunks contain any of ``layers``."""
        found = set()
        for c in range(self.num_chunks):
            r = self.layers_of(c)
            if any(i in r for i in layers):
                found.add(self.owner(c))
        return sorted(found)


def load_plan(path: str | os.PathLike[str]) -> Any:
    """Read plan.json: a full ``autopipe.planner.plan.Plan``, or a hand-written ``{"boundaries": [...]}``
    (with, optionally, ``"placement": "replica-inner"``)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise RecordError(f"no plan at {p}; run `autopipe convert`, or pass --plan even.") from None
    except ValueError as e:
        raise RecordError(f"{p} is not valid JSON ({e}).") from None
    if isinstance(data, dict) and set(data) <= {"boundaries", "stage_ranks", "schedule", "microbatches", "placement"}:
        if "boundaries" not in data:
            raise RecordError(f"{p} has no 'boundaries'.")
        placement = data.get("placement", "pipeline-inner")
        if placement not in PLACEMENTS:
            raise RecordError(f"{p} has placement {placement!r}; use one of {', '.join(PLACEMENTS)}.")
        return SimpleNamespace(boundaries=tuple(data["boundaries"]), stage_ranks=tuple(data.get("stage_ranks", ())),
                               placement=placement)
    from ..planner.plan import Plan

    return Plan.from_dict(data)


def plan_placement(path: str | os.PathLike[str]) -> str:
    """The placement plan.json at ``path`` numbers its ranks by ("pipeline-inner" for ``even``, for
    plans without one, and for a file ``load_plan`` will refuse: read before the process group
    exists, which needs it, while what is wrong with the file is ``load_plan``'s to say, once every
    rank can report it in one line)."""
    if str(path) == "even":
        return "pipeline-inner"
    try:
        value = json.loads(Path(path).read_text()).get("placement", "pipeline-inner")
    except (OSError, ValueError, AttributeError):
        return "pipeline-inner"
    return value if value in PLACEMENTS else "pipeline-inner"
