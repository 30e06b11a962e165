"""The one record the runtime reads: what each pipeline rank runs.

A :class:`~autopipe.planner.plan.Plan` says far more than a rank needs (every chunk's predicted
times, the memory breakdown, the baselines it beat). A rank needs the cut, the rank of each chunk,
the schedule, how the world's ranks are numbered, the data-parallel layout, the device type the
model was traced for and what the plan promised. ``Plan.stage_plan()`` gives exactly that, and
``autopipe.planner.plan.load_plan`` gives the same record for a hand-written ``{"boundaries": [...]}`` plan.json.

Which rank runs which chunk is decided once, by ``autopipe.planner.schedules.place_chunks``: looped
schedules (GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble) give chunk c to rank c % S, V-shaped
ones (ZBVZeroBubble, DualPipeV) go down and back up (rank r holds chunks r and 2S-1-r), as torch's
``generate_stage_to_rank_mapping`` does. Every rank must know every chunk's owner before any
schedule exists (to materialise its parameters and build the tied-weight groups), so the record
carries the owners rather than asking torch.

A hand-written plan names no stage count: :meth:`StagePlan.placed` fixes it when the run knows
how many pipeline ranks it has (one process may run every chunk of any plan, for debugging).

Example:
    >>> plan = StagePlan((0, 2, 4, 5, 6), schedule="interleaved1f1b").placed(2)
    >>> plan.chunk_ranks, plan.chunks_of(1), plan.layers_of(3)
    ((0, 1, 0, 1), [1, 3], range(5, 6))
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..choices import PLACEMENTS
from ..errors import PartitionError, RecordError
from .schedules import place_chunks

__all__ = ["SCHEDULES", "StagePlan", "even_boundaries", "plan_placement", "schedule_name", "schedule_style"]

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
    """The canonical spelling of a schedule name (case and '-'/'_' ignored).

    >>> schedule_name("zbv"), schedule_name("Interleaved-1F1B")
    ('ZBVZeroBubble', 'Interleaved1F1B')
    """
    key = name.lower().replace("-", "").replace("_", "")
    if key not in SCHEDULES:
        raise PartitionError(f"unknown schedule {name!r}; use one of {', '.join(dict.fromkeys(SCHEDULES.values()))}.")
    return SCHEDULES[key]


def schedule_style(name: str) -> str:
    """``"v"`` for V-shaped schedules, ``"loop"`` for the others."""
    return "v" if schedule_name(name) in _V_SHAPED else "loop"


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


@dataclass(frozen=True)
class StagePlan:
    """What the runtime runs: the cut, the rank of each chunk, the schedule and the world's layout.

    Chunk c holds layers ``boundaries[c]:boundaries[c+1]`` and runs on pipeline rank
    ``chunk_ranks[c]``. A record with ``stages == 0`` is not placed yet (a hand-written cut):
    :meth:`placed` places it on the run's pipeline ranks.
    """

    boundaries: tuple[int, ...]  # C + 1 layer indices from 0 to L
    # torch.distributed.pipelining's name of the schedule (schedule_name): GPipe, 1F1B, Interleaved1F1B, ...
    schedule: str = "1F1B"
    stages: int = 0  # pipeline ranks the chunks are placed on; 0: not placed (any count dividing the chunks)
    chunk_ranks: tuple[int, ...] = ()  # the pipeline rank of each chunk; () until placed
    microbatches: int = 0  # per step, as planned; 0: not planned (a hand-written cut)
    recompute: tuple[str, ...] = ()  # per chunk: none, selective or full; (): none planned
    placement: str = "pipeline-inner"  # how the world's stages x dp ranks are numbered (choices.PLACEMENTS)
    dp: int = 1  # data-parallel replicas of each stage
    zero: int = 0  # the ZeRO stage they shard with
    tp: int = 1  # tensor-parallel ranks inside each stage (world = stages x dp x tp, tp innermost)
    sequence_parallel: bool = False  # the plan's Plan.sequence_parallel (train.py's default; preflight warns on a mismatch)
    ep: int = 1  # expert-parallel degree over the dp replicas (Plan.ep; ep divides dp)
    trace_device: str = ""  # the device type the plan's layers were traced for; "": not recorded
    gpus_per_node: int = 0  # devices per node the world is laid out on; 0: one node
    # What the plan promised for the run it was made for (None / (): a hand-written cut): the whole
    # step in seconds (``Plan.predicted_step``), each pipeline rank's peak memory in bytes, and what
    # made the profile behind the step doubtful ("" when nothing did: ``Plan.profile_noise``).
    step_time: float | None = None
    rank_memory: tuple[int, ...] = ()
    step_noise: str = ""

    def __post_init__(self) -> None:
        cuts = tuple(int(b) for b in self.boundaries)
        object.__setattr__(self, "boundaries", cuts)
        object.__setattr__(self, "schedule", schedule_name(self.schedule))
        for name in ("chunk_ranks", "recompute", "rank_memory"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if len(cuts) < 2 or cuts[0] != 0 or any(b <= a for a, b in itertools.pairwise(cuts)):
            raise PartitionError(f"boundaries {list(cuts)} must be strictly increasing from 0.")
        if self.chunk_ranks and (len(self.chunk_ranks) != self.num_chunks
                                 or any(not 0 <= r < max(self.stages, 1) for r in self.chunk_ranks)):
            raise PartitionError(f"chunk ranks {list(self.chunk_ranks)} do not place {self.num_chunks} chunks on "
                                 f"{self.stages} stages.")
        if self.placement not in PLACEMENTS:
            raise RecordError(f"placement {self.placement!r}; use one of {', '.join(PLACEMENTS)}.")

    @classmethod
    def even(cls, num_layers: int, chunks: int, *, schedule: str = "1F1B") -> StagePlan:
        """``chunks`` runs of (nearly) equal length (``even_boundaries``), not placed yet."""
        return cls(tuple(even_boundaries(num_layers, chunks)), schedule=schedule)

    # ---- the cut ---------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return len(self.boundaries) - 1

    @property
    def num_layers(self) -> int:
        return self.boundaries[-1]

    @property
    def pp_size(self) -> int:
        """The pipeline ranks it is placed on (1 until placed)."""
        return max(self.stages, 1)

    @property
    def multi(self) -> bool:
        """Whether the schedule is a multi-chunk (PipelineScheduleMulti) one."""
        return self.schedule not in _SINGLE

    @property
    def world(self) -> int:
        """Processes the plan runs on: stages x data-parallel replicas."""
        return self.pp_size * self.dp

    @property
    def nodes(self) -> int:
        """Nodes the world spans (1 unless ``gpus_per_node`` is given and smaller than the world)."""
        per = self.gpus_per_node
        return -(-self.world // per) if per and self.world > per else 1

    def layers_of(self, chunk: int) -> range:
        return range(self.boundaries[chunk], self.boundaries[chunk + 1])

    def recompute_of(self, chunk: int) -> str:
        """Chunk ``chunk``'s planned recompute mode ("none" where the plan planned none)."""
        return self.recompute[chunk] if self.recompute else "none"

    # ---- who runs what ---------------------------------------------------------------------
    def owner(self, chunk: int) -> int:
        """The pipeline rank that runs ``chunk``."""
        if not self.chunk_ranks:
            raise PartitionError("this cut is not placed on pipeline ranks yet; call .placed(pp_size) first.")
        return self.chunk_ranks[chunk]

    def chunks_of(self, pp_rank: int) -> list[int]:
        """The chunks ``pp_rank`` runs, in pipeline order."""
        return [c for c in range(self.num_chunks) if self.owner(c) == pp_rank]

    def ranks_holding(self, layers: Sequence[int]) -> list[int]:
        """Sorted pipeline ranks whose chunks contain any of ``layers``."""
        return sorted({self.owner(c) for c in range(self.num_chunks) if any(i in self.layers_of(c) for i in layers)})

    def placed(self, pp_size: int, schedule: str | None = None) -> StagePlan:
        """This cut on ``pp_size`` pipeline ranks under ``schedule`` (default: its own), each chunk's
        rank fixed; refuses a count or schedule the cut cannot run on, in one line.

        One rank runs every chunk, whatever the schedule (plain ``python train.py``).
        """
        name = schedule_name(schedule or self.schedule)
        chunks = self.num_chunks
        if pp_size == 1:
            return replace(self, schedule=name, stages=1, chunk_ranks=(0,) * chunks)
        if pp_size < 1 or chunks % pp_size:
            raise PartitionError(
                f"{chunks} chunks cannot be spread evenly over {pp_size} pipeline ranks; "
                f"make a plan with a multiple of {pp_size} stages (stages x virtual stages)."
            )
        per_rank = chunks // pp_size
        if name in _SINGLE and per_rank != 1:
            raise PartitionError(
                f"{name} runs one chunk per rank but the plan has {per_rank} per rank; "
                "use Interleaved1F1B (or InterleavedZeroBubble) for virtual stages."
            )
        if name in _V_SHAPED and per_rank != 2:
            raise PartitionError(
                f"{name} needs exactly 2 chunks per rank, the plan has {per_rank}; partition with virtual_stages=2."
            )
        owners = place_chunks(pp_size, chunks, v_shaped=name in _V_SHAPED)
        if self.chunk_ranks and self.stages > 1 and owners != self.chunk_ranks:
            raise PartitionError(
                f"the plan places chunks on ranks {list(self.chunk_ranks)} but {name} runs them on "
                f"{list(owners)}; make the plan for schedule {name} (or run the plan's own schedule)."
            )
        return replace(self, schedule=name, stages=pp_size, chunk_ranks=owners)

    def predicts(self, *, schedule: str, microbatches: int, pp_size: int, dp: int = 1, zero: int = 0) -> bool:
        """Whether the plan's promises (``step_time``, ``rank_memory``) hold for a run of this
        schedule, micro-batch count, stage count, replica count and ZeRO stage."""
        if self.step_time is None or not self.rank_memory:
            return False
        return (self.schedule == schedule_name(schedule) and self.microbatches == microbatches
                and self.stages == pp_size and self.dp == dp
                and (dp == 1 or self.zero == zero))  # one replica shards nothing


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
