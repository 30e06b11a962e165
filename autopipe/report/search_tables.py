"""Rich output of the cluster search: the top layouts, why each ranks below the first, and the counts."""

from __future__ import annotations

from rich.table import Table

from ..cluster.hints import why_behind
from ..cluster.layouts import Layout, SearchResult
from ..units import format_bytes

__all__ = ["search_table", "search_summary", "rate"]


def rate(x: Layout) -> str:
    """'216,833 tok/s (105.9 samples/s)', or samples alone for a model without tokens."""
    samples = f"{x.throughput:.4g} samples/s" if x.throughput is not None else "?"
    return f"{x.tokens_per_second:,.0f} tok/s ({samples})" if x.tokens_per_second else samples


def _links(x: Layout) -> str:
    return f"{x.placement}: p2p {x.p2p_link}, DP {x.dp_link}"


def search_table(result: SearchResult, top: int | None = None) -> Table:
    """One row per layout, best first: its shape, links, predicted throughput, step, peak and the why."""
    table = Table(title=f"best layouts of {result.gpus} devices ({result.gpus_per_node} per node), "
                        f"global batch {result.global_batch}", title_justify="left")  # fmt: skip
    for col in ("#", "tp", "layout", "placement", "throughput", "step", "peak memory", "recompute", "against #1"):
        table.add_column(col, justify="right" if col in ("#", "tp", "step", "peak memory") else "left")
    best = result.layouts[0]
    for i, x in enumerate(result.layouts[: top or result.top]):
        modes = sorted(set(x.recompute) - {"none"})
        tp = f"{x.tp}{' SP' if x.sequence_parallel else ''}"
        table.add_row(str(i + 1), tp, x.label, _links(x), rate(x), f"{(x.step_time or 0) * 1e3:.1f} ms",
                      format_bytes(x.peak_memory or 0), ", ".join(modes) or "none",
                      "best" if i == 0 else why_behind(x, best))  # fmt: skip
    return table


def search_summary(result: SearchResult) -> str:
    """'searched 524 layouts in 6.1 s: 106 refused by the memory bound, ...'."""
    return (f"searched {result.considered} layouts in {result.seconds:.1f} s: {result.pruned_memory} refused by the "
            f"memory bound, {result.pruned_dominated} dominated (ZeRO 3 beside 2), {result.pruned_bound} "
            f"pruned by the throughput bound, {result.solved} solved ({result.infeasible} with no cut that fits)")  # fmt: skip
