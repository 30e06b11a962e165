"""Rich tables for the terminal: a profile's layers, a plan's stages, several partitioners side by side."""

from __future__ import annotations

from typing import Sequence

from rich.table import Table

from ..choices import RECOMPUTE_MODES
from ..costs.layer_costs import Profile
from ..planner.plan import Plan
from ..units import format_bytes, format_time, shorten
from .predicted import step_text

__all__ = ["plan_table", "compare_table", "plan_summary", "profile_table", "restriction_phrase", "stage_table"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def plan_table(plan: Plan, title: str = "") -> Table:
    """One row per chunk: rank, layers, times (ms per micro-batch), memory, in-flight micro-batches."""
    table = Table(title=title or f"{plan.method}: {plan.num_layers} layers into {plan.num_chunks} chunks")
    recompute = any(mode != "none" for mode in plan.stage_recompute)  # a column only when some chunk recomputes
    cols = ("chunk", "rank", "layers", "first layer", "time ms", "fwd ms", "bwd ms", "comm ms", "memory", "in flight")
    for col in cols + (("recompute",) if recompute else ()):
        table.add_column(col, justify="left" if col in ("layers", "first layer", "recompute") else "right")
    for c in range(plan.num_chunks):
        a, b = plan.boundaries[c], plan.boundaries[c + 1]
        slow = c == plan.bottleneck_stage
        table.add_row(
            f"{c}{' *' if slow else ''}",
            str(plan.stage_ranks[c]),
            f"{a}..{b - 1} ({b - a})",
            plan.stage_first_layers[c] if plan.stage_first_layers else "",
            _ms(plan.stage_times[c]),
            _ms(plan.stage_forward[c]),
            _ms(plan.stage_backward[c]),
            _ms(2 * plan.stage_comm[c]),
            format_bytes(plan.stage_memory[c]),
            plan.inflight_text(c),
            *((plan.recompute_of(c),) if recompute else ()),
            style="bold" if slow else None,
        )
    return table


def limit_phrase(plan: Plan) -> str:
    """' of 80.00 GiB (the device's memory)' — the limit the plan was held to, and whence; '' for none."""
    if plan.memory_limit is None:
        return ""
    whence = " (the device's memory)" if plan.memory_limit_source == "device" else ""
    return f" of {format_bytes(plan.memory_limit)}{whence}"


def recompute_phrase(plan: Plan) -> str:
    """'; recompute: full on chunks 0, 1 (+2.1 ms per micro-batch at most)' — '' when no chunk recomputes."""
    chosen = [(c, mode) for c, mode in enumerate(plan.stage_recompute) if mode != "none"]
    if not chosen:
        return ""
    by_mode: dict[str, list[int]] = {}
    for c, mode in chosen:
        by_mode.setdefault(mode, []).append(c)
    what = "; ".join(f"{mode} on chunk{'s' if len(cs) > 1 else ''} {', '.join(map(str, cs))}" for mode, cs in by_mode.items())
    cost = max(plan.stage_recompute_time, default=0.0)
    return f"; recompute: {what} (+{_ms(cost)} ms per micro-batch at most)"


def sharding_phrase(plan: Plan) -> str:
    """'; per rank with 2 replicas, ZeRO 1 (chosen)' — '' for one replica."""
    if plan.dp <= 1:
        return ""
    chosen = " (chosen)" if plan.zero_policy == "auto" else ""
    return f"; per rank with {plan.dp} data-parallel replicas, ZeRO {plan.zero}{chosen}"


def plan_summary(plan: Plan) -> str:
    """One line: bottleneck, balance, step and bubble, autopipe's step when this is a baseline, and the bound."""
    line = (
        f"bottleneck chunk {plan.bottleneck_stage}: {_ms(plan.bottleneck_time)} ms/micro-batch, "
        f"balance (max/mean) {plan.balance:.3f}, peak memory {format_bytes(plan.peak_memory)}{limit_phrase(plan)}"
        f"{sharding_phrase(plan)}{recompute_phrase(plan)}, "
        f"{plan.schedule} step with {plan.microbatches} micro-batches {_ms(plan.step_time)} ms "
        f"(bubble {plan.bubble_fraction:.1%})"
    )
    if plan.predicted_step != plan.step_time or plan.profile_noise:
        # the schedule's step above is what the cut is solved for; the job's promise counts more (report.predicted)
        line += f"; predicted step {step_text(plan)}"
    if plan.optimum_step_time is not None:
        line += f"; autopipe's step {_ms(plan.optimum_step_time)} ms"
    if plan.step_lower_bound is not None:
        gap = plan.step_gap or 0.0
        line += f"; step lower bound {_ms(plan.step_lower_bound)} ms, " + ("optimal" if gap == 0 else f"gap {gap:.2%}")
    if plan.tp > 1:  # the figures above are one tp rank's (autopipe.costs.tp.at_tp)
        line += f"; tensor-parallel {plan.tp}{' with sequence parallelism' if plan.sequence_parallel else ''} in each stage"
    return line + restriction_phrase(plan)


def restriction_phrase(plan: Plan) -> str:
    """'; cut for torchtitan (between whole modules): +1.2% against 5.10 ms unrestricted' — '' when not restricted."""
    if plan.allowed_cuts is None:
        return ""
    who = plan.target or "the cuts given"
    cost = plan.restriction_cost
    if cost is None or plan.unrestricted_step_time is None:
        return f"; cut only where {who} can"
    against = f"against {_ms(plan.unrestricted_step_time)} ms unrestricted"
    return f"; cut only where {who} can: " + ("nothing lost" if cost == 0 else f"+{cost:.2%}") + f" {against}"


def compare_table(plans: Sequence[Plan]) -> Table:
    """Partitioners side by side on the same profile; the first plan is the reference (autopipe)."""
    best = plans[0]
    table = Table(title=f"{best.num_layers} layers, {best.num_chunks} chunks, {best.schedule}, {best.microbatches} micro-batches")
    for col in ("method", "step ms", "vs autopipe", "bottleneck ms", "max/mean", "peak memory", "memory per stage", "fits"):
        table.add_column(col, justify="left" if col in ("method", "memory per stage") else "right")
    for p in plans:
        ratio = p.step_time / best.step_time if best.step_time > 0 else 1.0  # the objective: the step
        fits = "-" if p.memory_limit is None else ("yes" if p.peak_memory <= p.memory_limit else "NO")
        table.add_row(
            p.method,
            _ms(p.step_time),
            f"{ratio:.3f}x",
            _ms(p.bottleneck_time),
            f"{p.balance:.3f}",
            format_bytes(p.peak_memory),
            " ".join(format_bytes(m).replace(" ", "") for m in p.rank_memory),
            fits,
        )
    return table


def profile_table(prof: Profile) -> Table:
    """A rich table of a profile, one row per layer: time share, memory, bytes out.

    ``act`` is what a layer keeps for backward; the caption adds what the whole model keeps under
    each recompute mode and the backward time it adds (per layer: ``LayerCost.recompute``, in the JSON).
    """
    total = sum(prof.times) or 1.0
    table = Table(title=f"{prof.model or 'model'}: {prof.mode} on {prof.device.name} ({prof.dtype})",
                  title_justify="left")
    modes = [m for m in RECOMPUTE_MODES[1:] if any(m in c.recompute for c in prof.layers)]
    # static = parameters + gradients + optimizer state; act = saved for backward per micro-batch
    for col in ("#", "layer", "fwd ms", "bwd ms", "share", "static", "act", "peak", "out", ""):
        table.add_column(col, justify="left" if col in ("layer", "") else "right", no_wrap=col != "layer",
                         min_width=12 if col == "layer" else None)
    for c in prof.layers:
        table.add_row(
            str(c.index), c.name, f"{c.forward_time * 1e3:.3f}", f"{c.backward_time * 1e3:.3f}",
            f"{100 * c.time / total:.1f}%", format_bytes(c.static_bytes), format_bytes(c.activation_bytes),
            format_bytes(max(c.peak_forward_bytes, c.peak_backward_bytes)), format_bytes(c.output_bytes),
            ("tied " if c.tied else "") + ("=" if c.source == "reused" else ""),
        )
    activations = sum(c.activation_bytes for c in prof.layers)
    lines = [f"total {total * 1e3:.2f} ms per micro-batch {prof.microbatch}; activations "
             f"{format_bytes(activations)}; '=' reuses an identical layer"]
    for m in modes:
        kept = sum(c.recompute[m].activation_bytes if m in c.recompute else c.activation_bytes for c in prof.layers)
        extra = sum(c.recompute[m].extra_backward_time for c in prof.layers if m in c.recompute)
        lines.append(f"{m} recompute: activations {format_bytes(kept)} ({100 * kept / (activations or 1):.0f}%), "
                     f"backward +{extra * 1e3:.2f} ms ({100 * extra / total:.0f}% of the step)")
    table.caption = "\n".join(lines)
    return table


def stage_table(plan: Plan, profile: Profile, title: str = "") -> Table:
    """One row per stage: its layers, time per micro-batch, memory, and load against the slowest."""
    table = Table(title=title or None, title_justify="left")
    for col in ("stage", "layers", "first … last layer", "time/mb", "memory", "load"):
        table.add_column(col, justify="left" if col in ("first … last layer", "load") else "right",
                         no_wrap=col != "first … last layer")
    for c in range(plan.num_chunks):
        a, b = plan.boundaries[c], plan.boundaries[c + 1]
        first, last = _label(profile.layers[a].name), _label(profile.layers[b - 1].name)
        names = first if b - a == 1 else f"{first} … {last}"
        share = plan.stage_times[c] / plan.bottleneck_time if plan.bottleneck_time > 0 else 1.0
        over = plan.memory_limit is not None and plan.stage_memory[c] > plan.memory_limit // plan.virtual_stages
        memory = format_bytes(plan.stage_memory[c])
        stage = str(c) if plan.virtual_stages == 1 else f"{c} (rank {plan.stage_ranks[c]})"
        table.add_row(
            stage, f"{a}–{b - 1}" if b - a > 1 else str(a), shorten(names, 40), format_time(plan.stage_times[c]),
            f"[red]{memory}[/]" if over else memory,
            f"{'█' * round(share * 8):<8} {share:4.0%}",
        )
    return table


def _label(name: str) -> str:
    """A layer made of several glue modules is named by its first: 'transformer.wte (+2)'."""
    parts = name.split(", ")
    return parts[0] if len(parts) == 1 else f"{parts[0]} (+{len(parts) - 1})"
