"""The cluster search's records: a Layout (one way to run the job on N devices, with its predictions
once solved), the SearchResult (saved as search.json), and the enumeration of layouts. No torch.
See autopipe/cluster/layout_search.py for the search itself.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..choices import ZERO_STAGES
from ..files import check_header, read_json, write_json_atomic
from ..planner.plan import Plan
from ..planner.schedules import check_schedule
from .topology import Cluster, placements, tp_cluster

__all__ = ["Layout", "SearchResult", "SEARCH_SCHEDULES", "enumerate_layouts", "search_path"]

# (schedule, virtual stages) tried; one stage runs 1f1b only (every schedule is the same chain there).
SEARCH_SCHEDULES: tuple[tuple[str, int], ...] = (("1f1b", 1), ("gpipe", 1), ("interleaved1f1b", 2),
                                                 ("interleaved1f1b", 4), ("zbv", 2))  # fmt: skip
SEARCH_SCHEMA = 1


@dataclass(frozen=True)
class Layout:
    """One way to run the job on the cluster, and (once solved) what it is predicted to do."""

    stages: int
    dp: int
    microbatch_size: int  # samples per micro-batch
    microbatches: int  # per step, per replica
    schedule: str
    virtual_stages: int
    zero: int
    placement: str  # topology.PLACEMENTS
    p2p_link: str = ""  # intra | inter | none
    dp_link: str = ""
    bound: float = float("inf")  # the throughput no cut of this layout can beat (samples/s)
    step_time: float | None = None  # pipeline step + the reduction's tail, seconds
    pipeline_time: float | None = None  # the schedule's simulated step
    reduce_time: float | None = None  # the slowest rank's own data-parallel traffic
    throughput: float | None = None  # samples/s
    tokens_per_second: float | None = None
    peak_memory: int | None = None
    fits: bool = True  # within the memory limit (a baseline's cut may not be)
    recompute: tuple[str, ...] = ()  # per chunk
    boundaries: tuple[int, ...] = ()
    ideal_time: float | None = None  # M × the mean rank's compute: no bubble, no communication
    recompute_time: float | None = None  # M × the mean rank's recompute seconds
    p2p_time: float | None = None  # M × the mean rank's send/recv seconds
    # tensor-parallel degree inside each stage (devices = stages × dp × tp; tp innermost, in one node)
    tp: int = 1
    sequence_parallel: bool = False
    # expert-parallel degree over the replicas (ep divides dp; MoE profiles only: Plan.ep)
    ep: int = 1

    @property
    def gpus(self) -> int:
        return self.stages * self.dp * self.tp

    @property
    def global_batch(self) -> int:
        return self.microbatch_size * self.microbatches * self.dp

    @property
    def label(self) -> str:
        """'tp 2 × 8 stages × 8 replicas, 2×16 micro-batches, 1f1b, ZeRO 1' (v when > 1, tp when > 1, SP when on)."""
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        tp = f"tp {self.tp}{' SP' if self.sequence_parallel else ''} × " if self.tp > 1 else ""
        tp += f"ep {self.ep} × " if self.ep > 1 else ""
        return (f"{tp}{self.stages} stage{'s' if self.stages > 1 else ''} × {self.dp} replica{'s' if self.dp > 1 else ''}, {self.microbatches} micro-batches of {self.microbatch_size}, "
                f"{self.schedule}{v}, ZeRO {self.zero}")  # fmt: skip

    def key(self) -> tuple:
        return (self.stages, self.dp, self.microbatch_size, self.microbatches, self.schedule, self.virtual_stages,
                self.zero, self.placement, self.tp, self.sequence_parallel, self.ep)  # fmt: skip


@dataclass(frozen=True)
class SearchResult:
    """The solved layouts (best first), the search's counts, and the best layout's Plan."""

    layouts: tuple[Layout, ...]  # every solved layout that fits, best first
    gpus: int
    gpus_per_node: int
    bandwidth_intra: float
    bandwidth_inter: float
    global_batch: int
    memory_limit: int | None
    considered: int  # layouts enumerated
    pruned_memory: int  # refused by the memory bound without solving
    pruned_bound: int  # whose throughput bound could not beat the top ones
    pruned_dominated: int  # ZeRO 3 beside ZeRO 2 (see search())
    solved: int  # partition calls
    infeasible: int  # solved, but no cut fits
    seconds: float
    top: int = 3
    plan: Plan | None = field(default=None, compare=False, repr=False)  # the best layout's; saved apart
    schema: int = SEARCH_SCHEMA

    @property
    def best(self) -> Layout | None:
        return self.layouts[0] if self.layouts else None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "plan"}
        d["layouts"] = [asdict(x) for x in self.layouts]
        return {"kind": "autopipe.search", **d}  # schema is among the fields

    def save(self, path: str) -> None:
        write_json_atomic(path, self.to_dict())

    @classmethod
    def load(cls, path: str) -> SearchResult:
        data = read_json(path, "search")
        check_header(data, "search", SEARCH_SCHEMA, "search again with this version (autopipe plan --gpus)")
        data.pop("kind", None)
        data["layouts"] = tuple(Layout(**{**x, "recompute": tuple(x["recompute"]), "boundaries": tuple(x["boundaries"])})
                                for x in data["layouts"])  # fmt: skip
        return cls(**data)


def search_path(plan_path: str | os.PathLike[str]) -> Path:
    """Where a searched plan's layouts are saved beside it: plan.json -> plan.search.json."""
    p = Path(plan_path)
    return p.with_name(p.stem + ".search.json")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(num_layers: int, cluster: Cluster, global_batch: int, *,
                      schedules: Sequence[tuple[str, int]] = SEARCH_SCHEDULES,
                      zeros: Sequence[int] = ZERO_STAGES, microbatch_sizes: Sequence[int] | None = None,
                      tp: int = 1, sequence_parallel: bool = False) -> Iterator[Layout]:  # fmt: skip
    """Every layout of the cluster for the global batch (unsolved) at tensor-parallel degree ``tp``
    (its groups of tp devices placed as the cluster search's ranks: topology.tp_cluster); see the
    module docstring."""
    groups = tp_cluster(cluster, tp)
    for s in _divisors(groups.gpus):
        r = groups.gpus // s
        if s > num_layers or global_batch % r:
            continue
        per_replica = global_batch // r
        for b in _divisors(per_replica):
            if microbatch_sizes is not None and b not in microbatch_sizes:
                continue
            m = per_replica // b
            for schedule, v in schedules if s > 1 else (("1f1b", 1),):
                if s * v > num_layers or (schedule == "interleaved1f1b" and m % s):
                    continue
                check_schedule(schedule, s, v, m)
                for z in zeros if r > 1 else (0,):
                    for p in placements(groups, stages=s, dp=r):
                        yield Layout(s, r, b, m, schedule, v, z, p.order, p.p2p_link, p.dp_link, tp=tp,
                                     sequence_parallel=sequence_parallel and tp > 1)  # fmt: skip
