"""report.html's section for a plan that came from the cluster search: every solved layout as a
point of predicted throughput against peak memory per device (the front: no layout above and to
the left of it is better in both), the memory limit, and the top layouts with why each loses."""

from __future__ import annotations

from ..cluster.hints import why_behind
from ..cluster.layouts import Layout, SearchResult
from ..units import format_bytes
from .search_tables import rate
from .svg import LEFT, PALETTE, WIDTH, escape, nice_ticks, tick

__all__ = ["search_section", "pareto_front"]

_SCHEDULE_COLOURS = {"1f1b": PALETTE[0], "gpipe": PALETTE[1], "interleaved1f1b": PALETTE[2], "zbv": PALETTE[4]}


def pareto_front(layouts: list[Layout]) -> list[Layout]:
    """The layouts no other beats on both throughput and peak memory, by increasing memory.

    >>> a = Layout(1, 1, 1, 1, "1f1b", 1, 0, "pipeline-inner", throughput=1.0, peak_memory=10)
    >>> b = Layout(2, 1, 1, 1, "1f1b", 1, 0, "pipeline-inner", throughput=2.0, peak_memory=20)
    >>> c = Layout(4, 1, 1, 1, "1f1b", 1, 0, "pipeline-inner", throughput=1.5, peak_memory=30)
    >>> [x.stages for x in pareto_front([a, b, c])]
    [1, 2]
    """
    front, best = [], float("-inf")
    for x in sorted(layouts, key=lambda y: (y.peak_memory or 0, -(y.throughput or 0.0))):
        if (x.throughput or 0.0) > best:
            front.append(x)
            best = x.throughput or 0.0
    return front


def _chart(result: SearchResult) -> str:
    pts = [x for x in result.layouts if x.throughput and x.peak_memory]
    height, bottom = 300, 40
    xmax = max([x.peak_memory or 0 for x in pts] + [result.memory_limit or 0]) * 1.08
    ymax = max(x.throughput or 0.0 for x in pts) * 1.1
    span = WIDTH - LEFT - 40

    def px(mem: float) -> float:
        return LEFT + span * mem / xmax

    def py(thr: float) -> float:
        return 10 + height - height * thr / ymax

    out = [f"<svg width=\"{WIDTH}\" height=\"{height + bottom + 10}\">"]
    for v in nice_ticks(ymax / 1.1):
        out.append(f"<line x1=\"{LEFT}\" x2=\"{WIDTH}\" y1=\"{py(v):.1f}\" y2=\"{py(v):.1f}\" stroke=\"#eee\"/>"
                   f"<text x=\"{LEFT - 6}\" y=\"{py(v) + 4:.1f}\" text-anchor=\"end\">{v:g}</text>")
    for v in nice_ticks(xmax / 1.08, binary=True):
        out.append(f"<text x=\"{px(v):.1f}\" y=\"{height + 28}\" text-anchor=\"middle\">{escape(tick(format_bytes, v))}</text>")
    out.append(f"<text x=\"12\" y=\"{10 + height / 2:.0f}\" transform=\"rotate(-90 12 {10 + height / 2:.0f})\" "
               f"text-anchor=\"middle\">samples/s</text>")
    if result.memory_limit:
        x = px(result.memory_limit)
        out.append(f"<line x1=\"{x:.1f}\" x2=\"{x:.1f}\" y1=\"10\" y2=\"{height + 10}\" stroke=\"#c0392b\" "
                   f"stroke-width=\"2\" stroke-dasharray=\"6 3\"/><text x=\"{x - 4:.1f}\" y=\"22\" text-anchor=\"end\" "
                   f"style=\"fill:#c0392b\">limit {escape(format_bytes(result.memory_limit))}</text>")
    front = pareto_front(pts)
    path = " ".join(f"{px(x.peak_memory or 0):.1f},{py(x.throughput or 0):.1f}" for x in front)
    out.append(f"<polyline points=\"{path}\" fill=\"none\" stroke=\"#444\" stroke-width=\"1.5\"/>")
    for i, x in enumerate(pts):
        colour = _SCHEDULE_COLOURS.get(x.schedule, "#999")
        r = 7 if i == 0 else 4
        out.append(f"<circle cx=\"{px(x.peak_memory or 0):.1f}\" cy=\"{py(x.throughput or 0):.1f}\" r=\"{r}\" "
                   f"fill=\"{colour}\" fill-opacity=\"{1 if i == 0 else 0.6}\" stroke=\"{'#000' if i == 0 else 'none'}\">"
                   f"<title>{escape(x.label)}: {escape(rate(x))}, {escape(format_bytes(x.peak_memory or 0))}</title></circle>")
    out.append("</svg>")
    legend = " ".join(f"<span class=\"sw\" style=\"background:{c}\"></span>{s}" for s, c in _SCHEDULE_COLOURS.items())
    return f"<p class=\"note\">{legend}; the line joins the front, the ringed point is the plan</p>" + "".join(out)


def _table(result: SearchResult) -> str:
    best = result.layouts[0]
    rows = ["<table><tr><th>#</th><th class=\"l\">layout</th><th class=\"l\">placement</th><th>throughput</th>"
            "<th>step</th><th>peak memory</th><th class=\"l\">against #1</th></tr>"]
    for i, x in enumerate(result.layouts[: result.top]):
        mark = ' class="best"' if i == 0 else ""
        why = "the plan" if i == 0 else escape(why_behind(x, best))
        rows.append(f"<tr{mark}><td>{i + 1}</td><td class=\"l\">{escape(x.label)}</td>"
                    f"<td class=\"l\">{escape(x.placement)}: p2p {escape(x.p2p_link)}, DP {escape(x.dp_link)}</td>"
                    f"<td>{escape(rate(x))}</td><td>{(x.step_time or 0) * 1e3:.1f} ms</td>"
                    f"<td>{escape(format_bytes(x.peak_memory or 0))}</td>"
                    f"<td class=\"l\">{why}</td></tr>")
    return "".join(rows) + "</table>"


def search_section(result: SearchResult) -> tuple[str, str, str]:
    """(title, HTML, note) for report.render_report's _section."""
    note = (f"Every layout of {result.gpus} devices ({result.gpus_per_node} per node) the search solved for a global "
            f"batch of {result.global_batch}: {result.considered} considered, {result.pruned_memory} refused by the "
            f"memory bound, {result.pruned_dominated} dominated, {result.pruned_bound} pruned by the throughput bound, "
            f"{result.solved} solved ({result.infeasible} with no cut that fits), in {result.seconds:.1f} s. "
            "Throughput is predicted: the schedule's simulated step plus the gradient reduction after each rank's "
            "last op, over the link its placement gives (docs/search.md).")
    return "Cluster search: throughput against peak memory", _chart(result) + _table(result), note
