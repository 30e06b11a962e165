"""Why a layout of the cluster search ranks below the best, in words. No torch."""

from __future__ import annotations

from ..units import format_bytes
from .layouts import Layout

__all__ = ["why_behind"]


def why_behind(x: Layout, best: Layout) -> str:
    """Why layout ``x`` steps slower than ``best``, by the largest differences of the step's parts
    (per step, the mean rank): compute, bubble, send/recv, recompute, the reduction's tail.

    >>> from autopipe.cluster.layouts import Layout
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
