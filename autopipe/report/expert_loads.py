"""The report's MoE section: each MoE layer's measured expert load and what its skew costs the plan.

Per layer: the busiest expert's share of the routed slots (p50 and p95 over the batches the profile
counted, autopipe.costs.moe_shape), a small bar per expert of its mean share (the dashed mark is a
balanced 1/E), and the seconds the skew adds per step over a balanced router at the plan's ep
(autopipe.costs.ep.ep_terms: the busiest ep rank's experts, and its all-to-alls, times the
micro-batches). At ep 1 every replica holds every expert and the skew costs nothing; the section then
says what it would cost at the degrees the experts allow.
"""

from __future__ import annotations

from ..costs.ep import EP_DEGREES, ep_terms
from ..costs.layer_costs import Profile
from ..planner.plan import Plan
from .svg import escape

__all__ = ["expert_section"]

_W = 12  # px per expert bar
_H = 28


def _bars(shares: tuple[float, ...]) -> str:
    top = max(max(shares), 1e-9)
    fair = 1.0 / len(shares)
    w = _W * len(shares)
    parts = [f'<svg width="{w}" height="{_H}" role="img">']
    for e, s in enumerate(shares):
        h = _H * s / top
        parts.append(f'<rect x="{e * _W + 1}" y="{_H - h:.1f}" width="{_W - 2}" height="{h:.1f}" fill="#4c78a8">'
                     f"<title>expert {e}: {s:.1%}</title></rect>")
    y = _H - _H * fair / top
    parts.append(f'<line x1="0" x2="{w}" y1="{y:.1f}" y2="{y:.1f}" stroke="#c0392b" stroke-dasharray="3,2"/></svg>')
    return "".join(parts)


def _link(profile: Profile) -> float:
    from ..cluster.topology import LINKS

    name = profile.device.name.lower() if profile.device.type != "cpu" else "cpu"
    key = next((k for k in LINKS if k in name), "cpu")
    return LINKS[key][0]


def expert_section(plan: Plan, profile: Profile) -> tuple[str, str, str] | None:
    """(title, HTML, note) of the section, or None when the profile records no MoE layer."""
    layers = [l for l in profile.layers if l.moe is not None]
    if not layers:
        return None
    bw = _link(profile)
    experts = layers[0].moe.experts  # type: ignore[union-attr]
    degrees = [plan.ep] if plan.ep > 1 else [e for e in EP_DEGREES if e > 1 and experts % e == 0]
    costs = {e: {t.index: t.skew_seconds * plan.microbatches for t in ep_terms(profile, e, bandwidth=bw)} for e in degrees}
    head = "".join(f"<th>skew cost at ep {e} (ms/step)</th>" for e in degrees)
    rows = []
    for l in layers:
        m = l.moe
        assert m is not None
        cells = "".join(f"<td>{costs[e][l.index] * 1e3:.3f}</td>" for e in degrees)
        rows.append(f'<tr><td class="l">{escape(l.name)}</td><td>{m.busiest(0.5):.1%}</td><td>{m.busiest(0.95):.1%}</td>'
                    f"<td>{len(m.loads)}</td><td class=\"l\">{_bars(m.shares())}</td>{cells}</tr>")
    total = "".join(f"<td><b>{sum(costs[e].values()) * 1e3:.3f}</b></td>" for e in degrees)
    table = (f'<table><tr><th class="l">layer</th><th>busiest expert p50</th><th>p95</th><th>batches</th>'
             f'<th class="l">mean share per expert</th>{head}</tr>{"".join(rows)}'
             f'<tr><td class="l">all MoE layers</td><td></td><td></td><td></td><td></td>{total}</tr></table>')
    where = (f"this plan's ep {plan.ep}" if plan.ep > 1 else
             "ep 1 (this plan: every replica holds every expert, so the skew costs nothing); the columns are what it "
             "would cost at each degree the experts allow")
    note = (f"Each MoE layer's routed slots per expert, counted on the untouched model over the profile's batches: "
            f"the busiest expert's share (p50, p95 over batches) and each expert's mean share (the dashed line is a "
            f"balanced 1/{experts}). The skew cost is what the busiest ep rank's extra experts' compute and its "
            f"larger all-to-alls add per step over a balanced router (priced at p95, {bw / 1e9:g} GB/s link), at "
            f"{where}; it adds to the stage holding the layer.")
    return "Mixture of experts: expert load and what the skew costs", table, note
