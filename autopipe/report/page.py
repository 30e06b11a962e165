"""report.html: one self-contained page a person reads to judge a plan (inline CSS and SVG, no scripts).

It shows, for a Plan (and its Profile when there is one):

- per-layer forward/backward time and memory, as bars coloured by stage, with the cut points;
- per-stage load (forward, backward, send/recv) and per-rank memory against the limit;
- autopipe's plan beside the baselines users know (uniform, parameters, torchtitan, greedy);
- the simulated schedule: which rank is busy when, and where the bubbles are;
- given a training run's step log, what was measured beside what the plan predicted.

Nothing is fetched when it is opened: no external stylesheet, font, script or image.

Example:
    >>> from autopipe.costs.layer_costs import Profile
    >>> from autopipe.planner import compare_baselines, partition
    >>> profile = Profile.from_costs([1, 4, 4, 4, 4, 3])
    >>> plan = partition(profile, 3)
    >>> html = render_report(plan, profile, baselines=compare_baselines(profile, plan))
    >>> html[:15]
    '<!DOCTYPE html>'
    >>> write_report("jobs/gpt2/report.html", plan, profile)
    PosixPath('jobs/gpt2/report.html')
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path
from typing import Mapping, Sequence

from ..costs.layer_costs import Profile
from ..costs.noise import noisy_phrase
from ..errors import AutopipeError
from ..files import write_text_atomic
from ..planner.plan import Plan
from ..units import format_bytes, format_microbatch, format_time, shorten
from .breakdown import StepBreakdown, breakdown_table
from .predicted import step_figure, step_parts
from .steplog import Comparison
from .svg import (
    LEFT,
    PALETTE,
    WIDTH,
    escape,
    hbars,
    nice_ticks,
    stage_colour,
    tint,
    value_axis,
)

__all__ = ["render_report", "write_report"]


def write_report(
    path: str | os.PathLike[str],
    plan: Plan,
    profile: Profile | None = None,
    *,
    baselines: Mapping[str, Plan] | None = None,
    title: str | None = None,
    measured: Comparison | None = None,
    search: object | None = None,
    breakdowns: Sequence[StepBreakdown] | None = None,
) -> Path:
    """Render the report and write it to ``path`` (via a temporary name, so no half-written file)."""
    text = render_report(plan, profile, baselines=baselines, title=title, measured=measured, search=search,
                         breakdowns=breakdowns)  # fmt: skip
    return write_text_atomic(path, text)


def render_report(
    plan: Plan,
    profile: Profile | None = None,
    *,
    baselines: Mapping[str, Plan] | None = None,
    title: str | None = None,
    measured: Comparison | None = None,
    search: object | None = None,
    breakdowns: Sequence[StepBreakdown] | None = None,
) -> str:
    """The report as one HTML string. Without a profile the per-layer charts and baselines are left out;
    with ``measured`` (``autopipe.report.steplog.compare``) a section sets the run beside the predictions; with
    ``search`` (the SearchResult the plan came from) the layouts' throughput against peak memory; with
    ``breakdowns`` (``autopipe.report.breakdown``) where measured steps went, beside the plan's terms."""
    if profile is not None and len(profile.layers) != plan.num_layers:
        raise AutopipeError(
            f"the profile has {len(profile.layers)} layers but the plan cuts {plan.num_layers}: they belong to "
            "different models. Pass the profile.json written with this plan."
        )
    if profile is not None and profile.signature and plan.signature and profile.signature != plan.signature:
        raise AutopipeError(
            f"the plan was made for signature {plan.signature} but the profile has {profile.signature}: they belong "
            "to different models or flatten options. Pass the profile.json written with this plan."
        )
    name = title or (profile.model if profile is not None and profile.model else "model")
    parts = [_header(name, plan, profile), _stage_table(plan)]
    if search is not None and getattr(search, "layouts", None):
        from .search_section import search_section

        parts.append(_section(*search_section(search)))  # type: ignore[arg-type]
    if measured is not None:
        parts.append(_section("Measured against predicted", _measured_table(plan, measured),
                              f"From the training run's step log ({measured.steps} steps after warm-up): the median "
                              "step time and each pipeline rank's largest peak memory, beside what the plan "
                              "predicted. A ratio above 1 means the run took more than the plan said."))
    if breakdowns:
        parts.append(_section("Where a step went", breakdown_table(plan, list(breakdowns)),
                              "Seconds per step of each part on each pipeline rank, from torch's profiler (which slows "
                              "a step) with ranges around each part (bench/bench_peers.py), beside what the plan "
                              "charges each rank: its forward, backward and sends times the micro-batches. Waiting "
                              "for a neighbour shows in p2p; 'other' is the rest of the step."))
    if profile is not None:
        parts.append(_section("Per layer: time", _layer_time_chart(plan, profile),
                              "Forward (light) and backward (dark) time per micro-batch of each layer inside the "
                              "whole model (the times the stage table adds up), coloured by the stage that runs it. "
                              "Dashed lines are the cut points."))
        parts.append(_section("Per layer: memory", _layer_memory_chart(plan, profile),
                              "Parameters, gradients and optimizer state (dark) and saved activations times the "
                              "micro-batches the schedule keeps in flight on that stage (light)."))
        from .expert_loads import expert_section

        moe = expert_section(plan, profile)
        if moe is not None:
            parts.append(_section(*moe))
    parts.append(_section("Per stage: load", _stage_load_chart(plan),
                          "Forward, backward and send/recv time of each stage per micro-batch. The slowest stage "
                          "sets the pace of the whole pipeline."))
    parts.append(_section("Per rank: memory", _rank_memory_chart(plan) + _rank_breakdown_table(plan),
                          "Peak memory of each pipeline rank" + (" against the limit (red line)" if plan.memory_limit
                                                                 else "; no memory limit was given")
                          + ". The peak is what lives all step (weights, gradients, optimizer state, buffers, "
                          "reserve; with data-parallel replicas the all-reduce buckets, or under ZeRO 2/3 the weights "
                          "and gradients gathered for the step) plus the activations held for the micro-batches in "
                          "flight, the last output, and the larger of the largest transient and the reduce-scatter input; "
                          "or, if larger, the optimizer step's temporaries, after the activations are freed. On a GPU "
                          "the caching allocator's slack, the CUDA context, cuBLAS workspaces and NCCL's buffers come "
                          "on top (autopipe/costs/gpu_memory.py says which figures are published and which assumed)"
                          + (f". Each stage has {plan.dp} data-parallel replicas under ZeRO {plan.zero}: weights, "
                             "gradients and optimizer state are this rank's shards" if plan.dp > 1 else "") + "."))
    if baselines:
        parts.append(_section("autopipe against the baselines", _baseline_table(plan, baselines),
                              "The same profile, stages, schedule and micro-batches, cut by the partitioners in "
                              "common use. Step time is the schedule simulated on a core or device per rank, what "
                              "each cut is judged by (the predicted step above counts more)."))
    parts.append(_section(f"Schedule: {plan.schedule}, {plan.microbatches} micro-batches", _timeline_chart(plan),
                          "One simulated training step. Each row is a pipeline rank; F is a forward, B a backward"
                          " (W a deferred weight gradient), numbered by micro-batch. Hatched grey is idle time: "
                          "the bubble."))
    body = "\n".join(parts)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>autopipe report: {escape(name)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n"
            f"<footer>written by autopipe on {stamp}; rebuild with <code>autopipe report plan.json</code></footer>"
            "\n</body></html>\n")


# ---- sections ------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1240px;color:#222;background:#fff;font-size:14px;line-height:1.4}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 4px}
p.note{color:#555;margin:2px 0 8px;max-width:1000px}
.facts{display:flex;flex-wrap:wrap;gap:8px;margin:12px 0}
.fact{border:1px solid #ddd;border-radius:6px;padding:6px 12px;min-width:120px}
.fact b{display:block;font-size:17px}.fact span{color:#666;font-size:12px;display:block}
.fact.step{max-width:440px}.fact i.noisy{display:block;font-size:12px;font-style:normal}
table{border-collapse:collapse;margin:8px 0}td,th{padding:3px 10px;border-bottom:1px solid #e4e4e4;text-align:right}
th{background:#f6f6f6}td.l,th.l{text-align:left}
.sw{display:inline-block;width:11px;height:11px;border-radius:2px;vertical-align:-1px;margin-right:5px}
tr.best td{font-weight:600}.over{color:#c0392b;font-weight:600}
svg{display:block;margin:6px 0}svg text{font-family:inherit;font-size:11px;fill:#333}
footer{margin-top:32px;color:#888;font-size:12px}code{background:#f3f3f3;padding:1px 4px;border-radius:3px}
"""


def _section(title: str, content: str, note: str) -> str:
    return f"<section><h2>{escape(title)}</h2><p class=\"note\">{escape(note)}</p>{content}</section>"


def _header(name: str, plan: Plan, profile: Profile | None) -> str:
    where = ""
    if profile is not None:
        verb = {"measured": "Costs measured on", "estimated": "Costs estimated for"}.get(profile.mode, "Costs given for")
        where = f"{verb} {profile.device.name} ({profile.dtype}), micro-batch {format_microbatch(profile.microbatch)}"
    limit = format_bytes(plan.memory_limit) if plan.memory_limit else "none"
    if plan.memory_limit and plan.memory_limit_source == "device":
        limit += " (device)"
    recomputed = sum(mode != "none" for mode in plan.stage_recompute)
    facts = [
        ("stages", str(plan.stages) + (f" × {plan.virtual_stages} virtual" if plan.virtual_stages > 1 else "")),
        ("layers", str(plan.num_layers)),
        ("schedule", f"{plan.schedule}, {plan.microbatches} mb"),
        # --schedule auto: the predicted whole step of each schedule planned, the simplest within the margin chosen
        *([("schedules planned (auto)", ", ".join(f"{s} {format_time(t)}" for s, t in plan.schedule_steps.items()))]
          if plan.schedule_policy == "auto" else []),
        # the solver's proof is about the schedule on a core (or device) per rank, not the predicted step
        *([("schedule's lower bound (a core per rank)", format_time(plan.step_lower_bound)
            + (" (optimal)" if plan.step_gap == 0 else f" (gap {plan.step_gap:.1%})" if plan.step_gap is not None else ""))]
          if plan.step_lower_bound is not None else []),  # no cut steps faster; plans before the field have none
        ("bubble", f"{plan.bubble_fraction:.0%}"),
        ("balance (slowest / mean)", f"{plan.balance:.2f}"),
        ("peak memory / limit", f"{format_bytes(plan.peak_memory)} / {limit}"),
        ("recompute", f"{recomputed} of {plan.num_chunks} stages" if recomputed else "none"),
        # cut only where the target engine can: the step beside the best unrestricted one
        *([(f"cuts for {plan.target or 'the cuts given'}",
            f"+{plan.restriction_cost:.1%} vs {format_time(plan.unrestricted_step_time)} unrestricted")]
          if plan.restriction_cost is not None and plan.unrestricted_step_time is not None else []),
    ]
    cells = _step_card(plan) + "".join(f"<div class=\"fact\"><span>{escape(k)}</span><b>{escape(v)}</b></div>"
                                       for k, v in facts)
    cuts = ", ".join(str(b) for b in plan.boundaries[1:-1])
    warned = "".join(f"<p class=\"note over\">warning: {escape(w)}</p>" for w in (profile.warnings if profile else ()))
    return (f"<header><h1>autopipe plan: {escape(name)}</h1><p class=\"note\">{escape(where)} — "
            f"cut by <b>{escape(plan.method)}</b> before layers {escape(cuts)}.</p>{warned}"
            f"<div class=\"facts\">{cells}</div></header>")


def _step_card(plan: Plan) -> str:
    """The predicted step (``Plan.predicted_step``, the figure convert printed and the step log sets
    beside each step), what it counts, and after a noisy profile the words that say so, beside it."""
    noisy = noisy_phrase(plan.profile_noise)
    said = f"<i class=\"noisy over\">{escape(noisy)}</i>" if noisy else ""
    return (f"<div class=\"fact step\"><span>predicted step</span><b>{escape(step_figure(plan))}</b>"
            f"<span>{escape(step_parts(plan))}</span>{said}</div>")


def _stage_table(plan: Plan) -> str:
    rows = []
    for c in range(plan.num_chunks):
        a, b = plan.boundaries[c], plan.boundaries[c + 1]
        first = plan.stage_first_layers[c] if c < len(plan.stage_first_layers) else ""
        share = plan.stage_times[c] / plan.bottleneck_time if plan.bottleneck_time > 0 else 1.0
        over = plan.memory_limit is not None and plan.stage_memory[c] > plan.memory_limit // plan.virtual_stages
        rows.append(
            f"<tr class=\"stage\" data-stage=\"{c}\"><td class=\"l\"><span class=\"sw\" style=\"background:{stage_colour(c)}\">"
            f"</span>{c}</td><td>{plan.stage_ranks[c]}</td><td>{a}–{b - 1}</td><td>{b - a}</td>"
            f"<td class=\"l\">{escape(shorten(first, 40))}</td><td>{format_time(plan.stage_forward[c])}</td>"
            f"<td>{format_time(plan.stage_backward[c])}</td><td>{format_time(2 * plan.stage_comm[c])}</td>"
            f"<td>{format_time(plan.stage_times[c])}</td><td>{share:.0%}</td>"
            f"<td{' class=over' if over else ''}>{format_bytes(plan.stage_memory[c])}</td>"
            f"<td>{escape(plan.inflight_text(c))}</td><td class=\"l recompute\">{escape(_recompute_cell(plan, c))}</td></tr>"
        )
    head = ("<tr><th class=\"l\">stage</th><th>rank</th><th>layers</th><th>#</th><th class=\"l\">first layer</th>"
            "<th>forward</th><th>backward</th><th>send/recv</th><th>total</th><th>of slowest</th><th>memory</th>"
            "<th>in flight</th><th class=\"l\">recompute</th></tr>")
    return f"<table class=\"stages\">{head}{''.join(rows)}</table>"


def _recompute_cell(plan: Plan, chunk: int) -> str:
    """'full, +1.2 ms' — the chunk's recompute mode and what it adds to each micro-batch's backward."""
    mode = plan.recompute_of(chunk)
    if mode == "none":
        return "none"
    extra = plan.stage_recompute_time[chunk] if chunk < len(plan.stage_recompute_time) else None
    return mode if extra is None else f"{mode}, +{format_time(extra)}"


_BREAKDOWN = (("weights", "weights"), ("gradients", "gradients"), ("optimizer", "optimizer state"),
              ("activations", "saved activations × in flight"), ("outputs", "last output held"),
              ("buffers", "send/recv buffers"), ("transient", "largest transient"),
              ("gathered", "gathered weights + gradients (ZeRO 2/3)"),
              ("data_parallel", "all-reduce buckets (ZeRO 0/1)"), ("reduce_scatter", "reduce-scatter input (ZeRO 2/3)"),
              ("optimizer_step", "optimizer step temporaries (peak: the larger of this and the activations' side)"),
              ("allocator", "CUDA caching allocator slack"), ("context", "CUDA context"),
              ("workspace", "cuBLAS workspaces"), ("nccl", "NCCL communicators and peer buffers"),
              ("reserve", "runtime reserve"))  # fmt: skip


def _rank_breakdown_table(plan: Plan) -> str:
    """Per rank, what its predicted peak is made of (autopipe.planner.memory.RankMemory)."""
    if not plan.rank_memory_breakdown:
        return ""
    ranks = plan.rank_memory_breakdown
    head = "<tr><th class=\"l\"></th>" + "".join(f"<th>rank {r}</th>" for r in range(len(ranks))) + "</tr>"
    rows = [f"<tr><td class=\"l\">{escape(label)}</td>" + "".join(f"<td>{format_bytes(d.get(key, 0))}</td>" for d in ranks)
            + "</tr>" for key, label in _BREAKDOWN if any(d.get(key, 0) for d in ranks)]  # fmt: skip
    over = [plan.memory_limit is not None and d.get("total", 0) > plan.memory_limit for d in ranks]
    rows.append("<tr><td class=\"l\"><b>peak</b></td>" + "".join(
        f"<td{' class=over' if o else ''}><b>{format_bytes(d.get('total', 0))}</b></td>" for d, o in zip(ranks, over)) + "</tr>")
    return f"<table class=\"rank-memory\">{head}{''.join(rows)}</table>"


def _baseline_table(plan: Plan, baselines: Mapping[str, Plan]) -> str:
    entries = [("autopipe", plan)] + [(k, v) for k, v in baselines.items()]
    best = min(p.step_time for _, p in entries)
    rows = []
    bar_w = 220
    longest = max(p.step_time for _, p in entries) or 1.0
    for method, p in entries:
        over = plan.memory_limit is not None and p.peak_memory > plan.memory_limit
        slower = (p.step_time / plan.step_time - 1) if plan.step_time > 0 else 0.0
        w = max(1.0, bar_w * p.step_time / longest)
        colour = PALETTE[0] if method == "autopipe" else "#999"
        bar = (f"<svg width=\"{bar_w}\" height=\"12\" style=\"display:inline;margin:0\"><rect width=\"{w:.1f}\" "
               f"height=\"12\" fill=\"{colour}\"/></svg>")
        rows.append(
            f"<tr class=\"method{' best' if p.step_time == best else ''}\" data-method=\"{escape(method)}\">"
            f"<td class=\"l\">{escape(method)}</td><td class=\"l\">{escape(', '.join(map(str, p.boundaries[1:-1])))}</td>"
            f"<td>{format_time(p.bottleneck_time)}</td><td>{format_time(p.step_time)}</td>"
            f"<td>{'—' if method == 'autopipe' else f'{slower:+.1%}'}</td><td>{p.bubble_fraction:.0%}</td>"
            f"<td{' class=over' if over else ''}>{format_bytes(p.peak_memory)}{' over limit' if over else ''}</td>"
            f"<td class=\"l\">{bar}</td></tr>"
        )
    head = ("<tr><th class=\"l\">method</th><th class=\"l\">cuts before layers</th><th>slowest stage</th>"
            "<th>step time</th><th>vs autopipe</th><th>bubble</th><th>peak memory</th><th class=\"l\">step time</th></tr>")
    return f"<table class=\"baselines\">{head}{''.join(rows)}</table>"


def _measured_table(plan: Plan, cmp: Comparison) -> str:
    def ratio(x: float) -> str:
        cls = " class=over" if math.isfinite(x) and abs(round(x * 100) - 100) > 10 else ""  # as printed
        return f"<td{cls}>{x:.2f}</td>" if math.isfinite(x) else "<td>—</td>"

    rows = [
        f"<tr><td class=\"l\">step time</td><td>{format_time(cmp.predicted_step_time)}</td>"
        f"<td>{format_time(cmp.measured_step_time)} (IQR {format_time(cmp.step_time_spread)})</td>{ratio(cmp.step_ratio)}</tr>"
    ]
    for r, (p, m, x) in enumerate(zip(cmp.predicted_memory, cmp.measured_memory, cmp.memory_ratios)):
        rows.append(f"<tr><td class=\"l\">rank {r} peak memory</td><td>{format_bytes(p)}</td>"
                    f"<td>{format_bytes(m) if m else '—'}</td>{ratio(x) if m else '<td>—</td>'}</tr>")
    head = "<tr><th class=\"l\"></th><th>predicted</th><th>measured</th><th>measured / predicted</th></tr>"
    return f"<table class=\"measured\">{head}{''.join(rows)}</table>"


# ---- charts --------------------------------------------------------------------------------------


def _stage_of_layers(plan: Plan) -> list[int]:
    owner = [0] * plan.num_layers
    for c in range(plan.num_chunks):
        for i in plan.layers_of(c):
            owner[i] = c
    return owner


def _layer_bars(plan: Plan, names: Sequence[str], low: Sequence[float], high: Sequence[float],
                fmt, label: str, low_name: str, high_name: str, high_light: bool) -> str:  # fmt: skip
    """Per-layer stacked bars (``low`` at the bottom), coloured by stage, with the cut points."""
    n = plan.num_layers
    height = 220
    top = max((lo + hi for lo, hi in zip(low, high)), default=0.0) * 1.08 or 1.0
    slot = (WIDTH - LEFT) / n
    gap = min(2.0, slot * 0.15)
    owner = _stage_of_layers(plan)
    out = [f"<svg class=\"layers\" width=\"{WIDTH}\" height=\"{height + 66}\">",
           value_axis(height, top, label, fmt)]
    base_y = 10 + height
    for i in range(n):
        x = LEFT + i * slot + gap / 2
        w = max(slot - gap, 0.8)
        colour = stage_colour(owner[i])
        h_lo = height * low[i] / top
        h_hi = height * high[i] / top
        lo_fill, hi_fill = (colour, tint(colour, 0.55)) if high_light else (tint(colour, 0.55), colour)
        tip = (f"layer {i} {names[i]} (stage {owner[i]}): {low_name} {fmt(low[i])}, {high_name} {fmt(high[i])}")
        out.append(f"<g class=\"layer\" data-layer=\"{i}\" data-stage=\"{owner[i]}\"><title>{escape(tip)}</title>"
                   f"<rect x=\"{x:.2f}\" y=\"{base_y - h_lo:.2f}\" width=\"{w:.2f}\" height=\"{h_lo:.2f}\" fill=\"{lo_fill}\"/>"
                   f"<rect x=\"{x:.2f}\" y=\"{base_y - h_lo - h_hi:.2f}\" width=\"{w:.2f}\" height=\"{h_hi:.2f}\" "
                   f"fill=\"{hi_fill}\"/></g>")
    out.append(f"<line x1=\"{LEFT}\" x2=\"{WIDTH}\" y1=\"{base_y}\" y2=\"{base_y}\" stroke=\"#888\"/>")
    every = max(1, round(n / 30))
    for i in range(0, n, every):
        out.append(f"<text x=\"{LEFT + (i + 0.5) * slot:.1f}\" y=\"{base_y + 14}\" text-anchor=\"middle\">{i}</text>")
    for c, cut in enumerate(plan.boundaries[1:-1], start=1):
        x = LEFT + cut * slot
        out.append(f"<line class=\"cut\" data-cut=\"{cut}\" x1=\"{x:.2f}\" x2=\"{x:.2f}\" y1=\"4\" y2=\"{base_y + 20}\" "
                   "stroke=\"#222\" stroke-width=\"1.5\" stroke-dasharray=\"5 3\"/>")
    # Stage names under the axis, centred on each stage's span.
    for c in range(plan.num_chunks):
        a, b = plan.boundaries[c], plan.boundaries[c + 1]
        mid = LEFT + (a + b) / 2 * slot
        out.append(f"<text x=\"{mid:.1f}\" y=\"{base_y + 34}\" text-anchor=\"middle\" style=\"font-weight:600;"
                   f"fill:{tint(stage_colour(c), -0.25)}\">stage {c}</text>")
    out.append(f"<text x=\"{LEFT}\" y=\"{base_y + 50}\">layer index; hover a bar for its name and values</text>")
    out.append("</svg>")
    return "".join(out)


def _layer_time_chart(plan: Plan, profile: Profile) -> str:
    # each layer as it runs inside the whole model (its gaps included: autopipe.costs.in_model), the
    # figures the plan's stage times add up; a layer timed alone read 395 ms per GPT-2 block where
    # the stage table put 5 blocks at 559 ms (issue 41)
    names = [c.name for c in profile.layers]
    forward = [c.forward_time + c.forward_gap for c in profile.layers]
    backward = [c.backward_time + c.backward_gap for c in profile.layers]
    return _layer_bars(plan, names, backward, forward, format_time, "time per micro-batch", "backward", "forward",
                       high_light=True)


def _layer_memory_chart(plan: Plan, profile: Profile) -> str:
    owner = _stage_of_layers(plan)
    names = [c.name for c in profile.layers]
    static = [float(c.static_bytes) for c in profile.layers]
    # a unit awaiting its weight pass (zbv) holds what the profile measured for that state
    acts = [float(c.activation_bytes * (plan.stage_inflight[owner[i]] - plan.waiting_of(owner[i]))
                  + c.weight_hold_bytes.get("none", c.activation_bytes) * plan.waiting_of(owner[i]))
            for i, c in enumerate(profile.layers)]  # fmt: skip
    return _layer_bars(plan, names, static, acts, format_bytes, "memory", "params+grads+optimizer",
                       "activations in flight", high_light=True)


def _stage_load_chart(plan: Plan) -> str:
    rows = []
    for c in range(plan.num_chunks):
        col = stage_colour(c)
        rows.append((f"stage {c}", [
            (plan.stage_forward[c], tint(col, 0.55), f"stage {c} forward {format_time(plan.stage_forward[c])}"),
            (plan.stage_backward[c], col, f"stage {c} backward {format_time(plan.stage_backward[c])}"),
            (2 * plan.stage_comm[c], "#888", f"stage {c} send/recv {format_time(2 * plan.stage_comm[c])}"),
        ]))
    legend = ("<p class=\"note\"><span class=\"sw\" style=\"background:#bbb\"></span>forward (light) "
              "<span class=\"sw\" style=\"background:#666\"></span>backward (dark) "
              "<span class=\"sw\" style=\"background:#888\"></span>send/recv (grey)</p>")
    mean = sum(plan.stage_times) / len(plan.stage_times)
    return legend + hbars(rows, max(plan.stage_times), format_time, marker=mean, marker_label="mean")


def _rank_memory_chart(plan: Plan) -> str:
    rows = []
    for r in range(plan.stages):
        chunks = plan.chunks_of(r)
        col = stage_colour(chunks[0]) if chunks else "#999"
        rows.append((f"rank {r}", [(float(plan.rank_memory[r]), col,
                                     f"rank {r} (stages {', '.join(map(str, chunks))}): {format_bytes(plan.rank_memory[r])}")]))
    limit = float(plan.memory_limit) if plan.memory_limit else None
    return hbars(rows, max(plan.rank_memory), format_bytes, limit=limit,
                  limit_label=f"limit {format_bytes(plan.memory_limit)}" if plan.memory_limit else "")


def _timeline_chart(plan: Plan) -> str:
    sim = plan.simulate()
    row_h, pad = 30, 8
    span = WIDTH - LEFT - 20
    step = sim.step_time or 1.0
    height = plan.stages * (row_h + pad) + 40
    out = [f"<svg class=\"timeline\" width=\"{WIDTH}\" height=\"{height}\">",
           "<defs><pattern id=\"idle\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" "
           "patternTransform=\"rotate(45)\"><rect width=\"6\" height=\"6\" fill=\"#f2f2f2\"/>"
           "<line x1=\"0\" y1=\"0\" x2=\"0\" y2=\"6\" stroke=\"#d0d0d0\" stroke-width=\"2\"/></pattern></defs>"]
    for v in nice_ticks(step):
        x = LEFT + span * v / step
        out.append(f"<line x1=\"{x:.1f}\" x2=\"{x:.1f}\" y1=\"0\" y2=\"{height - 26}\" stroke=\"#e6e6e6\"/>"
                   f"<text x=\"{x:.1f}\" y=\"{height - 12}\" text-anchor=\"middle\">{escape(format_time(v))}</text>")
    for r, ops in enumerate(sim.timeline):
        y = r * (row_h + pad) + 4
        busy = sim.busy[r] / step if step else 0.0
        out.append(f"<text x=\"{LEFT - 8}\" y=\"{y + row_h / 2 + 4}\" text-anchor=\"end\">rank {r} "
                   f"({busy:.0%})</text>")
        out.append(f"<rect class=\"idle\" x=\"{LEFT}\" y=\"{y}\" width=\"{span}\" height=\"{row_h}\" fill=\"url(#idle)\"/>")
        for start, end, kind, mb, chunk in ops:
            x = LEFT + span * start / step
            w = span * (end - start) / step
            col = stage_colour(chunk)
            fill = {"F": tint(col, 0.5), "B": col, "W": tint(col, -0.3)}.get(kind, col)
            out.append(f"<g class=\"op\" data-kind=\"{kind}\" data-rank=\"{r}\"><title>{escape(f'{kind} micro-batch {mb}, stage {chunk}: {format_time(start)} – {format_time(end)}')}</title>"
                       f"<rect x=\"{x:.2f}\" y=\"{y}\" width=\"{max(w - 0.5, 0.5):.2f}\" height=\"{row_h}\" fill=\"{fill}\" "
                       "stroke=\"#fff\" stroke-width=\"0.5\"/>")
            if w >= 16:
                out.append(f"<text x=\"{x + w / 2:.1f}\" y=\"{y + row_h / 2 + 4}\" text-anchor=\"middle\" "
                           f"style=\"fill:{'#222' if kind == 'F' else '#fff'}\">{kind}{mb}</text>")
            out.append("</g>")
    out.append("</svg>")
    has_w = any(op[2] == "W" for ops in sim.timeline for op in ops)
    # the timeline is the schedule alone, a core (or device) per rank; the predicted step may count more
    whole = (f" of the schedule alone, a core or device per rank (the predicted step, {step_figure(plan)}, counts "
             f"{step_parts(plan)})"
             if abs(plan.predicted_step - sim.step_time) > 1e-12 else "")
    legend = (f"<p class=\"note\">Step {format_time(sim.step_time)}{escape(whole)}; bubble {sim.bubble_fraction:.0%} of "
              f"{plan.stages} ranks × step time. <span class=\"sw\" style=\"background:{tint(PALETTE[0], 0.5)}\">"
              f"</span>forward <span class=\"sw\" style=\"background:{PALETTE[0]}\"></span>backward "
              + (f"<span class=\"sw\" style=\"background:{tint(PALETTE[0], -0.3)}\"></span>weight gradient "
                 if has_w else "")
              + "<span class=\"sw\" style=\"background:#eee;border:1px solid #ccc\"></span>idle</p>")
    return legend + "".join(out)
