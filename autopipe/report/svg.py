"""The report's drawing kit: inline SVG charts with no scripts, shared by every section of report.html.

Charts are ``WIDTH`` px wide with ``LEFT`` px kept for axis labels; colours come from ``PALETTE``
by stage. Every text that reaches the page goes through ``escape``.
"""

from __future__ import annotations

import html
import math

from ..units import format_bytes

__all__ = ["PALETTE", "WIDTH", "LEFT", "escape", "stage_colour", "tint", "nice_ticks", "tick", "value_axis", "hbars"]

# Tableau 10: distinct at a glance and readable for most colour-vision deficiencies.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
           "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac")  # fmt: skip

WIDTH = 1180  # px of every chart; the page is 1240 wide
LEFT = 86  # room for the axis labels


def escape(text: object) -> str:
    return html.escape(str(text), quote=True)


def stage_colour(stage: int) -> str:
    return PALETTE[stage % len(PALETTE)]


def tint(colour: str, amount: float) -> str:
    """Mix ``colour`` with white (amount > 0) or black (amount < 0)."""
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    target = 255 if amount > 0 else 0
    a = abs(amount)
    return "#" + "".join(f"{int(round(v + (target - v) * a)):02x}" for v in (r, g, b))


def nice_ticks(top: float, count: int = 4, *, binary: bool = False) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten apart) from 0 up to ``top``.

    ``binary``: for bytes, round in KiB/MiB/GiB so the labels read 256 MiB, not 268.44 MB.
    """
    if top <= 0:
        return [0.0]
    unit = 1.0
    if binary:
        while top / unit >= 1024:
            unit *= 1024
    raw = top / unit / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(s * mag for s in (1, 2, 2.5, 5, 10) if s * mag >= raw)
    return [i * step * unit for i in range(int(top / unit / step + 1e-9) + 1)]


def tick(fmt, value: float) -> str:  # type: ignore[no-untyped-def]
    """An axis label: '200 MiB' rather than '200.00 MiB'."""
    return fmt(value).replace(".00 ", " ")


def value_axis(height: float, top: float, label: str, fmt) -> str:
    """Horizontal grid lines with values on the left, for a chart whose bars grow upwards."""
    out = []
    for v in nice_ticks(top, binary=fmt is format_bytes):
        y = 10 + height - height * v / top
        out.append(f"<line x1=\"{LEFT}\" x2=\"{WIDTH}\" y1=\"{y:.1f}\" y2=\"{y:.1f}\" stroke=\"#eee\"/>"
                   f"<text x=\"{LEFT - 6}\" y=\"{y + 4:.1f}\" text-anchor=\"end\">{escape(tick(fmt, v))}</text>")
    out.append(f"<text x=\"12\" y=\"{10 + height / 2:.0f}\" transform=\"rotate(-90 12 {10 + height / 2:.0f})\" "
               f"text-anchor=\"middle\">{escape(label)}</text>")
    return "".join(out)


def hbars(rows: list[tuple[str, list[tuple[float, str, str]]]], top: float, fmt, limit: float | None = None,
           limit_label: str = "", marker: float | None = None, marker_label: str = "") -> str:  # fmt: skip
    """Horizontal stacked bars, one row per (label, [(value, colour, tooltip), ...])."""
    row_h, pad = 24, 6
    top = max(top, limit or 0.0, 1e-30) * 1.1
    span = WIDTH - LEFT - 120
    height = len(rows) * (row_h + pad) + 30
    out = [f"<svg class=\"hbars\" width=\"{WIDTH}\" height=\"{height}\">"]
    for v in nice_ticks(top / 1.1, binary=fmt is format_bytes):
        x = LEFT + span * v / top
        out.append(f"<line x1=\"{x:.1f}\" x2=\"{x:.1f}\" y1=\"0\" y2=\"{height - 24}\" stroke=\"#eee\"/>"
                   f"<text x=\"{x:.1f}\" y=\"{height - 10}\" text-anchor=\"middle\">{escape(tick(fmt, v))}</text>")
    for r, (label, parts) in enumerate(rows):
        y = r * (row_h + pad) + 4
        out.append(f"<text x=\"{LEFT - 8}\" y=\"{y + row_h / 2 + 4}\" text-anchor=\"end\">{escape(label)}</text>")
        x = float(LEFT)
        for value, colour, tip in parts:
            w = span * value / top
            out.append(f"<rect x=\"{x:.2f}\" y=\"{y}\" width=\"{max(w, 0):.2f}\" height=\"{row_h}\" fill=\"{colour}\">"
                       f"<title>{escape(tip)}</title></rect>")
            x += w
        total = sum(v for v, _, _ in parts)
        out.append(f"<text x=\"{x + 6:.1f}\" y=\"{y + row_h / 2 + 4}\">{escape(fmt(total))}</text>")
    for value, label, colour in ((limit, limit_label, "#c0392b"), (marker, marker_label, "#444")):
        if value:
            x = LEFT + span * value / top
            out.append(f"<line class=\"limit\" x1=\"{x:.1f}\" x2=\"{x:.1f}\" y1=\"0\" y2=\"{height - 24}\" "
                       f"stroke=\"{colour}\" stroke-width=\"2\" stroke-dasharray=\"6 3\"/>"
                       f"<text x=\"{x + 4:.1f}\" y=\"{height - 26}\" style=\"fill:{colour}\">{escape(label)}</text>")
    out.append("</svg>")
    return "".join(out)
