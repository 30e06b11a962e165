"""What the cluster search says in words: why a layout ranks below the best, and what would fit
when nothing does. No torch."""

from __future__ import annotations

from typing import Sequence

from .errors import AutopipeError
from .memory import ZERO_STAGES
from .records import Profile
from .topology import Cluster
from .units import format_bytes

__all__ = ["why_behind", "why_nothing_fits"]


def why_behind(x, best) -> str:  # type: ignore[no-untyped-def]  # (Layout, Layout) -> str
    """Why layout ``x`` steps slower than ``best``, by the largest differences of the step's parts
    (per step, the mean rank): compute, bubble, send/recv, recompute, the reduction's tail.

    >>> from autopipe.search import Layout
    >>> a = Layout(2, 2, 1, 4, "1f1b", 1, 0, "pipeline-inner", step_time=10.0, pipeline_time=9.0, ideal_time=8.0,
    ...            recompute_time=0.0, p2p_time=0.0, throughput=0.8)
    >>> b = Layout(4, 1, 1, 8, "1f1b", 1, 0, "pipeline-inner", step_time=13.0, pipeline_time=13.0, ideal_time=8.0,
    ...            recompute_time=0.0, p2p_time=1.0, throughput=0.6)
    >>> why_behind(b, a)
    '-25% throughput: bubble +3.00 s, send/recv +1.00 s, DP reduction -1.00 s'
    """
    if x.throughput is None or best.throughput is None:
        return ""

    def parts(y) -> dict[str, float]:  # type: ignore[no-untyped-def]
        bubble = y.pipeline_time - y.ideal_time - y.recompute_time - y.p2p_time
        return {"compute": y.ideal_time, "bubble": bubble, "send/recv": y.p2p_time,
                "recompute": y.recompute_time, "DP reduction": y.step_time - y.pipeline_time}  # fmt: skip

    mine, theirs = parts(x), parts(best)
    diff = sorted(((mine[k] - theirs[k], k) for k in mine), key=lambda t: -abs(t[0]))
    shown = [f"{k} {d:+.3g} s" if abs(d) < 0.01 else f"{k} {d:+.2f} s" for d, k in diff[:3] if abs(d) > 1e-12]
    if x.fits is False:
        shown.insert(0, f"over the memory limit ({format_bytes(x.peak_memory or 0)})")
    gain = x.throughput / best.throughput - 1
    head = f"{gain:+.0%} throughput" if abs(gain) >= 0.005 else "equal throughput"
    return f"{head}: {', '.join(shown)}" if shown else head


def why_nothing_fits(profile: Profile, cluster: Cluster, *, global_batch: int, limit: int | None,
                     optimizer: str | None, recompute: str, zeros: Sequence[int]) -> str:  # fmt: skip
    """One line: no layout fits; then what would (recompute auto, ZeRO, more devices, more memory)."""
    from .search import enumerate_layouts, evaluate, search

    head = (f"no layout of {cluster.gpus} devices fits {format_bytes(limit) if limit else 'the memory'} per device "
            f"for a global batch of {global_batch}")  # fmt: skip
    layouts = list(enumerate_layouts(len(profile.layers), cluster, global_batch, schedules=(("1f1b", 1),), zeros=zeros))
    if not layouts:
        return (f"no layout of {cluster.gpus} devices divides a global batch of {global_batch} among its replicas "
                f"(and has at most {len(profile.layers)} stages); use a global batch that is a multiple of the "
                "replica counts, or another --gpus.")  # fmt: skip
    hints: list[str] = []

    def feasible(c: Cluster, **kw) -> bool:  # type: ignore[no-untyped-def]
        opts = dict(global_batch=global_batch, memory_limit=limit, optimizer=optimizer, recompute=recompute,
                    zeros=zeros, schedules=(("1f1b", 1),), microbatch_sizes=(1,), top=1)  # fmt: skip
        try:
            search(profile, c, **{**opts, **kw})  # type: ignore[arg-type]
        except AutopipeError:
            return False
        return True

    if recompute != "auto" and feasible(cluster, recompute="auto"):
        hints.append("recompute auto (--recompute auto) would fit")
    if set(zeros) != set(ZERO_STAGES) and feasible(cluster, zeros=ZERO_STAGES):
        hints.append("more ZeRO stages (--zero auto) would fit")
    per = cluster.gpus_per_node
    for times in (2, 4, 8, 16, 32, 64):
        bigger = type(cluster)(cluster.gpus * times, per, cluster.intra, cluster.inter)
        if global_batch % times == 0 and feasible(bigger):
            hints.append(f"{bigger.gpus} devices would fit")
            break
    # the least memory among the simplest layouts, each cut with full recompute and no limit
    least = None
    deepest = sorted({x.stages for x in layouts})[-3:]  # deep pipelines hold the least per device
    simple = {(x.stages, x.zero): x for x in layouts if x.microbatch_size == 1 and x.stages in deepest}
    for x in simple.values():
        try:
            done, _ = evaluate(profile, cluster, x, memory_limit=None, optimizer=optimizer, recompute="full")
        except AutopipeError:
            continue
        if least is None or (done.peak_memory or 0) < (least.peak_memory or 0):
            least = done
    if least is not None:
        hints.append(f"{format_bytes(least.peak_memory or 0)} per device would fit ({least.label}, full recompute)")
    return f"{head}: {'; '.join(hints) or 'nothing tried fits'}."
