"""The Plan record: where to cut, what each stage then costs, and what the schedule predicts.

The partition pass produces it; ``LayerSequence.split(plan)`` and the emit pass read it. Chunk c
(``boundaries[c]:boundaries[c+1]``) runs on rank ``stage_ranks[c]``: c itself with one chunk per rank,
``c % stages`` (round-robin) for interleaved schedules, a V for zbv.

Example:
    >>> from autopipe import Profile, partition
    >>> plan = partition(Profile.from_costs([1, 1, 1, 1, 2, 2]), stages=3)
    >>> plan.boundaries, plan.bottleneck_time
    ((0, 3, 5, 6), 3.0)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..choices import PLACEMENTS
from ..errors import RecordError
from ..files import check_header, read_json, write_json_atomic
from .schedules import Simulation, simulate
from .stage_plan import StagePlan, schedule_name

__all__ = ["PLAN_SCHEMA", "Plan", "load_plan"]

PLAN_SCHEMA = 1


@dataclass(frozen=True)
class Plan:
    """A partition of a profiled layer sequence into pipeline chunks, with its predicted costs.

    With ``virtual_stages = 1`` a chunk is a stage. Times are seconds per micro-batch, memory bytes.
    """

    boundaries: tuple[int, ...]  # stages * virtual_stages + 1 layer indices, 0 .. num_layers
    stages: int  # pipeline ranks
    virtual_stages: int
    microbatches: int
    schedule: str
    memory_limit: int | None  # bytes per device; None: unlimited
    method: str  # autopipe | uniform | parameters | type:REGEX | torchtitan | greedy | manual
    signature: str  # the profile's; split() refuses a plan made for another model
    num_layers: int
    bandwidth: float  # bytes/s of the link between ranks; inf: communication ignored
    stage_ranks: tuple[int, ...]  # rank of each chunk
    stage_times: tuple[float, ...]  # per chunk: forward + backward + 2 x send/recv at its cuts
    stage_forward: tuple[float, ...]  # per chunk: forward compute
    stage_backward: tuple[float, ...]  # per chunk: backward compute, recomputation included
    stage_comm: tuple[float, ...]  # per chunk: send/recv seconds in one direction (+ the engine's per op)
    stage_memory: tuple[int, ...]  # per chunk: static bytes (tied once) + activations in flight
    stage_inflight: tuple[int, ...]  # per chunk: micro-batches of activations held at the chunk's own peak
    rank_times: tuple[float, ...]  # per rank: sum of its chunks' times
    # per rank: its chunks' memory at their heaviest joint state (memory.joint_peak), tied tensors once
    rank_memory: tuple[int, ...]
    bottleneck_stage: int  # the slowest chunk
    bottleneck_time: float
    peak_memory: int  # the largest rank_memory
    step_time: float  # simulated, for the schedule and micro-batches above
    bubble_fraction: float
    optimum_bottleneck_time: float | None = None  # autopipe's, when this plan is a baseline or manual
    optimum_step_time: float | None = None
    stage_first_layers: tuple[str, ...] = ()  # name of each chunk's first layer, for reports
    weight_share: float = 0.5  # part of the backward that zero-bubble schedules defer (W)
    optimizer: str | None = None  # whose state the memory counts; None: the profile's (plans before this field)
    # Per chunk: the recompute mode its times and memory assume ("none", "selective", "full");
    # () in plans made before recompute was planned: none everywhere.
    stage_recompute: tuple[str, ...] = ()
    recompute: str = "none"  # the policy asked for: none, auto, selective or full
    # Per chunk: seconds per micro-batch the recompute mode adds to the backward (0 for none); ()
    # in plans made before this field.
    stage_recompute_time: tuple[float, ...] = ()
    # No cut of these layers into these chunks has a shorter simulated step (proven; see
    # step_solver.py). Equal to step_time when this cut is proven optimal; None when not computed.
    step_lower_bound: float | None = None
    # Per rank: what rank_memory adds up (autopipe.planner.memory.RankMemory: weights, gradients, optimizer,
    # activations, outputs, buffers, transient, data_parallel, reserve, total); () in older plans.
    rank_memory_breakdown: tuple[dict[str, int], ...] = ()
    # Per chunk: of stage_inflight, the micro-batches past their input pass and waiting for their
    # weight pass at the chunk's peak (zero-bubble schedules; 0 otherwise); () in older plans.
    stage_waiting: tuple[int, ...] = ()
    # Where memory_limit came from: "given", "device" (the profile's GPU memory, the default) or ""
    # (no limit, or plans before this field).
    memory_limit_source: str = ""
    # Data-parallel replicas of each stage (world = stages x dp) and the ZeRO stage they shard with;
    # rank_memory is per rank under that sharding. zero_policy: what was asked ("0".."3" or "auto").
    dp: int = 1
    zero: int = 0
    zero_policy: str = "0"
    # How the world's stages x dp ranks are numbered (autopipe.choices.PLACEMENTS): the runtime builds
    # its process groups so, and the cluster search priced its links so. "pipeline-inner" in older plans.
    placement: str = "pipeline-inner"
    # Tensor-parallel degree inside each stage (world = stages x dp x tp; tp ranks are innermost, so a
    # tp group is tp consecutive ranks inside one node) and whether its norms and dropouts run
    # sequence-parallel (activations between the tp regions sharded on the sequence). 1 / False in
    # plans before these fields: every stage on one device per replica.
    tp: int = 1
    sequence_parallel: bool = False
    # Expert-parallel degree: each MoE layer's experts are sharded over ep of the data-parallel replicas
    # (ep divides dp; the ep group is ep consecutive dp ranks, as torchtitan's EP borrows dp_shard and
    # Megatron's experts' data-parallel group is dp / ep); tokens go to the rank holding their expert by
    # all-to-all and come back the same way. World unchanged (stages x dp x tp); an expert's gradient is
    # averaged over dp / ep replicas. 1 in plans before this field: every replica holds every expert.
    ep: int = 1
    # Devices per node the world is laid out on (the search's cluster, or convert --gpus-per-node);
    # 0: not given, one node. The job's launch lines (and its sbatch script) follow it.
    gpus_per_node: int = 0
    # The engine this plan was made for (torchtitan, megatron, deepspeed, fqns; "" any: autopipe's own)
    # and the only layers its chunks could start at (None: any). With a restriction, the step and cut
    # of the best unrestricted plan under the same options: what the restriction costs.
    target: str = ""
    allowed_cuts: tuple[int, ...] | None = None
    unrestricted_step_time: float | None = None
    unrestricted_boundaries: tuple[int, ...] | None = None
    # The device type the model was traced for ("cpu", "cuda"): Python in its forward that branches
    # on it took that branch. A job on another type retraces (and refuses in one line if the layers
    # differ); "" in plans made before this field.
    trace_device: str = ""
    # The engine the cut was costed for (torch, deepspeed; "" the layers alone) and the seconds its
    # step spends after the schedule (norm, optimizer step) on the slowest rank, measured per engine
    # (autopipe.costs.engines); step_time + step_overhead is the whole step (``total_step_time``).
    engine: str = ""
    step_overhead: float = 0.0
    # How the schedule was chosen: "auto" when planner.schedule_choice made every schedule's plan and
    # kept the simplest within schedule_margin (a fraction) of the least predicted whole step
    # (schedule_steps: each one planned, seconds; schedule_skipped: each one left out, why); "" when
    # the schedule was given (and in plans before these fields; a plan before the margin reads 0).
    schedule_policy: str = ""
    schedule_steps: dict[str, float] = field(default_factory=dict)
    schedule_skipped: dict[str, str] = field(default_factory=dict)
    schedule_margin: float = 0.0
    # A CPU job whose ranks (stages x dp, one thread each) outnumber the cores the profile saw: those
    # cores (0 otherwise: a core or device per rank, as on GPUs) and the step when the ranks share
    # them (schedules.shared_step: the same op order, the running ops sharing the cores evenly).
    # step_time stays the dedicated simulation, which the cut is solved for.
    cores: int = 0
    shared_step_time: float | None = None
    # What made the profile's times doubtful, in a few words (autopipe.costs.noise.noise_note: the runs'
    # spread, identical layers apart, the host's load); "" for a quiet profile and in older plans.
    # Said beside ``predicted_step`` wherever it is shown, the step log included.
    profile_noise: str = ""
    schema: int = PLAN_SCHEMA

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))

    @property
    def schedule_step_time(self) -> float:
        """The schedule's step as the job runs it: on cores the ranks share, ``shared_step_time``."""
        return self.shared_step_time if self.shared_step_time is not None else self.step_time

    @property
    def total_step_time(self) -> float:
        """The whole step: the schedule's simulated step plus what follows it (``step_overhead``; on
        shared cores every rank runs its optimizer at once, so it stretches by ranks over cores)."""
        share = self.world / self.cores if self.shared_step_time is not None and self.cores else 1.0
        return self.schedule_step_time + self.step_overhead * max(1.0, share)

    @property
    def predicted_step(self) -> float:
        """The step this plan predicts: the one figure convert prints, the job's README and report.html
        show and the step log sets beside each measured step (``StagePlan.step_time``). It is the whole
        step as the job runs it, ``total_step_time``: the schedule on the cores the ranks share (a CPU
        job with more ranks than cores) and what follows the schedule (norm, optimizer step). The
        dedicated ``step_time`` is what the cut is solved for, not a promise."""
        return self.total_step_time

    @property
    def num_chunks(self) -> int:
        return len(self.boundaries) - 1

    @property
    def world(self) -> int:
        """Processes the plan runs on: stages x data-parallel replicas x tensor-parallel degree."""
        return self.stages * self.dp * self.tp

    @property
    def nodes(self) -> int:
        """Nodes the plan's world spans (1 unless ``gpus_per_node`` is given and smaller than the world)."""
        per = self.gpus_per_node
        return -(-self.world // per) if per and self.world > per else 1

    @property
    def balance(self) -> float:
        """Slowest chunk over the mean chunk: 1.0 is perfectly balanced."""
        mean = sum(self.stage_times) / len(self.stage_times)
        return self.bottleneck_time / mean if mean > 0 else 1.0

    @property
    def restriction_cost(self) -> float | None:
        """How much longer the step is for cutting only where the target engine can: step / the best
        unrestricted step - 1 (0: nothing lost); None when the cuts were not restricted."""
        if self.unrestricted_step_time is None or self.unrestricted_step_time <= 0:
            return None
        cost = self.step_time / self.unrestricted_step_time - 1.0
        return cost if cost > 1e-9 else 0.0

    @property
    def step_gap(self) -> float | None:
        """How far step_time may be above the best possible step: step / lower bound - 1 (0: optimal)."""
        if self.step_lower_bound is None:
            return None
        if self.step_lower_bound <= 0:  # a bound of nothing: the gap is 0 only when the step is nothing too
            return 0.0 if self.step_time <= 0 else None
        gap = self.step_time / self.step_lower_bound - 1.0
        return gap if gap > 1e-9 else 0.0  # sums of the same seconds in another order differ in the last bits

    def recompute_of(self, chunk: int) -> str:
        """Chunk ``chunk``'s recompute mode ("none" for plans made before recompute was planned)."""
        return self.stage_recompute[chunk] if self.stage_recompute else "none"

    def waiting_of(self, chunk: int) -> int:
        """Of chunk ``chunk``'s micro-batches in flight at its peak, those waiting for their weight
        pass (zero-bubble schedules; 0 otherwise and in plans made before this was planned)."""
        return self.stage_waiting[chunk] if self.stage_waiting else 0

    def inflight_text(self, chunk: int) -> str:
        """'8' or, with units waiting for their weight pass, '8 (1 awaiting W)'."""
        w = self.waiting_of(chunk)
        return f"{self.stage_inflight[chunk]}" + (f" ({w} awaiting W)" if w else "")

    def layers_of(self, chunk: int) -> range:
        """Layer indices of chunk ``chunk``."""
        return range(self.boundaries[chunk], self.boundaries[chunk + 1])

    def chunks_of(self, rank: int) -> list[int]:
        """Chunks that rank ``rank`` runs, in model order."""
        return [c for c, r in enumerate(self.stage_ranks) if r == rank]

    def stage_plan(self) -> StagePlan:
        """What the runtime runs of this plan (``autopipe.planner.stage_plan.StagePlan``): the cut,
        each chunk's rank, the schedule by torch's name, the world's layout and the promises."""
        return StagePlan(self.boundaries, schedule=schedule_name(self.schedule), stages=self.stages,
                         chunk_ranks=self.stage_ranks, microbatches=self.microbatches,
                         recompute=self.stage_recompute, placement=self.placement, dp=self.dp, zero=self.zero,
                         tp=self.tp, sequence_parallel=self.sequence_parallel, ep=self.ep,
                         trace_device=self.trace_device, gpus_per_node=self.gpus_per_node,
                         step_time=self.predicted_step, rank_memory=self.rank_memory,
                         step_noise=self.profile_noise)

    def simulate(self, schedule: str | None = None, microbatches: int | None = None) -> Simulation:
        """Simulate one training step of this cut under ``schedule`` (default: the plan's own).

        ``plan.simulate("gpipe", 8).timeline[0]`` lists rank 0's ops as (start, end, kind, mb, chunk).
        """
        return simulate(
            self.schedule if schedule is None else schedule,
            forward=self.stage_forward,
            backward=self.stage_backward,
            comm=self.stage_comm,
            ranks=self.stages,
            microbatches=self.microbatches if microbatches is None else microbatches,
            weight_share=self.weight_share,
        )

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = "autopipe.plan"
        if d["bandwidth"] == float("inf"):
            d["bandwidth"] = None  # JSON has no infinity
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        check_header(d, "plan", PLAN_SCHEMA, "run `autopipe plan` again with this version")
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if d.get("bandwidth") is None:
            d["bandwidth"] = float("inf")
        try:
            plan = cls(**d)
        except TypeError as e:
            raise RecordError(f"plan is missing fields ({e}); run `autopipe plan` again.") from None
        _check_plan(plan)
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Plan":
        return cls.from_dict(read_json(path, "plan"))


_CHUNK_FIELDS = ("stage_ranks", "stage_times", "stage_forward", "stage_backward", "stage_comm", "stage_memory",
                 "stage_inflight")
_CHUNK_OPTIONAL = ("stage_first_layers", "stage_recompute", "stage_waiting")  # () in older plans
_RANK_FIELDS = ("rank_times", "rank_memory")


def _check_plan(plan: Plan) -> None:
    """Refuse a plan.json whose parts cannot belong together or whose figures cannot be (hand-edited or
    broken): one line naming the field, before anything reads it."""
    again = "run `autopipe plan` again rather than edit it."

    def number(value: Any, what: str, *, whole: bool = False, least: float = 0) -> None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= least
        if not ok or (whole and value != int(value)):
            kind = f"a whole number >= {least:g}" if whole else f"a finite number >= {least:g}"
            raise RecordError(f"plan {what} is {value!r}, but must be {kind}; {again}")

    b = plan.boundaries
    number(plan.num_layers, "num_layers", whole=True, least=1)
    if not b or b[0] != 0 or b[-1] != plan.num_layers or any(x >= y for x, y in zip(b, b[1:])):
        raise RecordError(f"plan boundaries {list(b)} are not increasing from 0 to {plan.num_layers}.")
    for f in ("stages", "virtual_stages", "microbatches"):
        number(getattr(plan, f), f, whole=True, least=1)
    chunks = len(b) - 1
    if chunks != plan.stages * plan.virtual_stages:
        raise RecordError(f"plan has {chunks} chunks (boundaries {list(b)}) but stages {plan.stages} x virtual_stages "
                          f"{plan.virtual_stages} = {plan.stages * plan.virtual_stages}; {again}")
    for f in _CHUNK_FIELDS + _CHUNK_OPTIONAL:
        n = len(getattr(plan, f))
        if n != chunks and not (f in _CHUNK_OPTIONAL and n == 0):
            raise RecordError(f"plan {f} has {n} entries for {chunks} chunks; {again}")
    for f in _RANK_FIELDS + ("rank_memory_breakdown",):
        n = len(getattr(plan, f))
        if n != plan.stages and not (f == "rank_memory_breakdown" and n == 0):
            raise RecordError(f"plan {f} has {n} entries for {plan.stages} stages; {again}")
    for c, r in enumerate(plan.stage_ranks):
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < plan.stages:
            raise RecordError(f"plan stage_ranks[{c}] is {r!r}, not a rank of its {plan.stages} stages; {again}")
    for f in ("stage_times", "stage_forward", "stage_backward", "stage_comm", "rank_times"):
        for i, v in enumerate(getattr(plan, f)):
            number(v, f"{f}[{i}]")
    for f in ("stage_memory", "stage_inflight", "stage_waiting", "rank_memory"):
        for i, v in enumerate(getattr(plan, f)):
            number(v, f"{f}[{i}]", whole=True)
    for c, (u, w) in enumerate(zip(plan.stage_inflight, plan.stage_waiting)):
        if w > u:
            raise RecordError(f"plan stage_waiting[{c}] is {w}, more than the {u} micro-batches in flight there; {again}")
    for f in ("bottleneck_time", "peak_memory", "step_time", "weight_share"):
        number(getattr(plan, f), f, whole=f == "peak_memory")
    number(plan.dp, "dp", whole=True, least=1)
    number(plan.tp, "tp", whole=True, least=1)
    if not isinstance(plan.sequence_parallel, bool):
        raise RecordError(f"plan sequence_parallel is {plan.sequence_parallel!r}, but must be true or false; {again}")
    if plan.sequence_parallel and plan.tp == 1:
        raise RecordError(f"plan sequence_parallel is true with tp 1 (nothing to shard over); {again}")
    number(plan.ep, "ep", whole=True, least=1)
    if plan.dp % plan.ep:
        raise RecordError(f"plan ep is {plan.ep}, but must divide dp ({plan.dp}): experts are sharded over "
                          f"data-parallel replicas; {again}")
    if plan.zero not in (0, 1, 2, 3) or isinstance(plan.zero, bool):
        raise RecordError(f"plan zero is {plan.zero!r}, but must be a ZeRO stage 0, 1, 2 or 3; {again}")
    if plan.placement not in PLACEMENTS:
        raise RecordError(f"plan placement is {plan.placement!r}, but must be one of {', '.join(PLACEMENTS)}; {again}")
    number(plan.gpus_per_node, "gpus_per_node", whole=True)
    if plan.nodes > 1 and plan.world % plan.gpus_per_node:
        raise RecordError(f"plan world of {plan.world} ranks (stages x dp x tp) is not a whole number of nodes of "
                          f"{plan.gpus_per_node} (gpus_per_node); {again}")
    number(plan.bubble_fraction, "bubble_fraction", least=-1e-9)  # 1 - busy/step: rounding may dip below 0
    for f in ("memory_limit", "step_lower_bound", "optimum_bottleneck_time", "optimum_step_time"):
        if getattr(plan, f) is not None:
            number(getattr(plan, f), f, whole=f == "memory_limit")
    if not (isinstance(plan.bandwidth, (int, float)) and plan.bandwidth > 0):  # inf: communication ignored
        raise RecordError(f"plan bandwidth is {plan.bandwidth!r}, but must be > 0 bytes/s (null: ignored); {again}")
    if not 0 <= plan.bottleneck_stage < chunks:
        raise RecordError(f"plan bottleneck_stage is {plan.bottleneck_stage!r}, not one of its {chunks} chunks; {again}")
    if plan.allowed_cuts is not None:
        outside = [x for x in b[1:-1] if x not in set(plan.allowed_cuts)]
        if outside:
            raise RecordError(f"plan boundaries {list(b)} start a chunk at layer {outside[0]}, which its allowed_cuts "
                              f"exclude; {again}")
    if plan.unrestricted_step_time is not None:
        number(plan.unrestricted_step_time, "unrestricted_step_time")
    number(plan.cores, "cores", whole=True)
    if plan.shared_step_time is not None:
        number(plan.shared_step_time, "shared_step_time")
    if not isinstance(plan.profile_noise, str):
        raise RecordError(f"plan profile_noise is {plan.profile_noise!r}, but must be text; {again}")
    if plan.schedule_policy not in ("", "auto") or not isinstance(plan.schedule_steps, dict):
        raise RecordError(f"plan schedule_policy is {plan.schedule_policy!r}, but must be 'auto' or ''; {again}")
    for name, step in plan.schedule_steps.items():
        number(step, f"schedule_steps[{name!r}]")
    number(plan.schedule_margin, "schedule_margin")
    for c, mode in enumerate(plan.stage_recompute):
        if mode not in ("none", "selective", "full"):
            raise RecordError(f"plan stage_recompute[{c}] is {mode!r}; use none, selective or full.")


_HAND_WRITTEN = {"boundaries", "stage_ranks", "schedule", "microbatches", "placement"}


def load_plan(path: str | os.PathLike[str]) -> StagePlan:
    """Read plan.json as the record the runtime runs: a full ``autopipe.planner.plan.Plan`` (its
    ``stage_plan()``), or a hand-written ``{"boundaries": [...]}`` (with, optionally,
    ``"stage_ranks"``, ``"schedule"``, ``"microbatches"`` and ``"placement": "replica-inner"``)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise RecordError(f"no plan at {p}; run `autopipe convert`, or pass --plan even.") from None
    except ValueError as e:
        raise RecordError(f"{p} is not valid JSON ({e}).") from None
    if isinstance(data, dict) and set(data) <= _HAND_WRITTEN:
        return _hand_written(p, data)
    return Plan.from_dict(data).stage_plan()


def _hand_written(p: Path, data: dict) -> StagePlan:
    if "boundaries" not in data:
        raise RecordError(f"{p} has no 'boundaries'.")
    placement = data.get("placement", "pipeline-inner")
    if placement not in PLACEMENTS:
        raise RecordError(f"{p} has placement {placement!r}; use one of {', '.join(PLACEMENTS)}.")
    ranks = tuple(int(r) for r in data.get("stage_ranks", ()))
    try:
        return StagePlan(tuple(data["boundaries"]), schedule=str(data.get("schedule", "1F1B")),
                         stages=max(ranks) + 1 if ranks else 0, chunk_ranks=ranks,
                         microbatches=int(data.get("microbatches", 0)), placement=placement)
    except (TypeError, ValueError) as e:
        raise RecordError(f"{p}: {e}") from None
