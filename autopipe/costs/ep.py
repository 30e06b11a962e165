"""Expert parallelism priced per layer: the profile one rank of an ep group sees. No torch.

A mixture-of-experts layer's :class:`~autopipe.costs.layer_costs.MoeShape` (counted on the untouched
model by autopipe.costs.moe_shape) says how its router spread the routed slots (token × top-k) over
the experts, batch by batch. :func:`at_ep` turns a Profile into the profile of one rank of an ep
group of ``ep`` consecutive data-parallel ranks (``Plan.ep``: ep divides dp, experts sharded over
the group in contiguous blocks ``[r·E/ep, (r+1)·E/ep)`` on rank r, each token's hidden state sent by
all-to-all to the ranks of its top-k experts and back), so ``partition`` and the cluster search run
unchanged on it. Every figure is per micro-batch; the layers without a MoeShape are unchanged.

Compute. Each of the ep ranks routes its own micro-batch's ``T·k`` slots; rank r runs the slots of
every rank that chose its experts, ``s_r · ep · T·k`` of them with ``s_r`` its experts' share of the
slots. The group waits for its busiest rank, so with ``σ`` the experts' share of the layer's
forward (FLOPs, autopipe.costs.moe_shape) and ``s`` the busiest rank's share at the chosen skew::

    f_ep = f · (1 − σ) + f · σ · (ep · s)          s = 1/ep balanced: the experts cost what they did

and the backward alike (its expert share taken as the forward's: both are the same matmuls, twice
as many backward). ``skew`` picks ``s``: ``p95`` (default) or ``p50`` of the per-batch busiest rank's
share over the batches counted, or ``balanced`` (1/ep, what a plan that ignores the router assumes).

All-to-all. Forward: dispatch (each rank's slots to their experts' ranks) and combine (back); the
backward the same two. The busiest rank receives ``ep·s·T·k`` hidden states, of which its own
``1/ep`` stay local, so each all-to-all takes, with ``B = T·k·h·bytes`` (``MoeShape.dispatch_bytes``)
and bw the link's bytes/s per device::

    a2a = ep · s · (ep − 1)/ep · B / bw + α        (balanced: (ep − 1)/ep · B / bw + α)

added twice to the forward and twice to the backward (on the critical path: the experts need their
tokens, the next op needs them back); the zero-bubble split charges the backward's to the input
gradients.

Count exchange. Before its dispatch each layer's forward sends every rank its count of slots per
expert (an all-to-all of E integers) and reads the split sizes to the host (the dispatch's shapes
depend on them): a fixed cost ``κ`` per MoE layer per micro-batch forward, its bytes negligible, on
the critical path (nothing of the layer's dispatch can start before it). The backward has none (the
all-to-alls' backward reuse the forward's splits); full recompute runs the forward again, so pays it
again.

The runner's own ops. At ep > 1 each experts call runs autopipe.runtime.stage.expert_parallel's
dispatch and combine around the experts: the slots sorted by expert, their rows gathered, the split
sizes expanded, and after the combine put back in slot order, weighted and summed over the top-k,
with the backward of each. None of it runs at ep 1, so the profile's layer time holds none of it.
Each rank does it on its own ``T·k`` slots whatever the degree and the skew, so it is one figure per
layer, ``ℓ_f`` forward and ``ℓ_b`` backward (``MoeShape.local_forward``/``local_backward``): that
function timed on the profiling host on one rank, its collectives a loopback and its experts the
identity (autopipe/runtime/checks/ep_timing.py; 0 where not timed: an estimate). On the bench's
tiny Mixtral it was ~0.5 ms a layer a micro-batch, ~12 ms of a 241 ms ep 2 step. Full recompute
runs the forward's again. So, per micro-batch::

    f_ep += 2·a2a + κ + ℓ_f          b_ep += 2·a2a + ℓ_b

α and κ: a CPU profile's host's own gloo figures (``DeviceInfo.links``, measured once per host by
autopipe/runtime/checks/links.py: gloo's all-to-all costs ~0.25 ms, the count exchange ~0.3-0.5 ms
on a 2026 Xeon, bench/results/gloo-links.md); on a GPU the stated NVLink figure, ``EP_LATENCY`` for
both (the count exchange is one all-to-all of a few integers there; the stream sync of its host
read is left out).

Memory. Expert parameters, gradients and optimizer state divide by ep: ``p_ep = p·(π/ep + 1 − π)``
with π the experts' share of the layer's parameter bytes. What the experts keep for backward scales
with their slots, ``a_ep = a + (ep·s − 1)·a_x`` with ``a_x`` those bytes at ep 1; the dispatch's
send and receive buffers (``B`` and ``ep·s·B``) are held during the layer's forward and backward
(its peaks). The tensor leaving the layer is unchanged (combine brings every token back).

ep = 1 returns the profile itself (the same object): today's numbers, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..errors import PartitionError
from .layer_costs import LayerCost, MoeShape, Profile
from .links import link_latency

__all__ = ["EP_DEGREES", "EP_LATENCY", "SKEWS", "EpTerms", "at_ep", "ep_terms", "check_ep", "ep_degrees_for",
           "busiest_share", "all_to_all", "has_experts", "ep_latencies"]  # fmt: skip

EP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
SKEWS: tuple[str, ...] = ("p95", "p50", "balanced")
# Per all-to-all latency: NCCL's all-to-all over a node's NVLink (nccl-tests alltoall_perf, 8 H100s)
# stays near 20 µs below a megabyte; twice the ring all-reduce's ~10 µs, as it opens ep−1 peers.
EP_LATENCY = 20e-6


def has_experts(profile: Profile) -> bool:
    """Whether any layer of ``profile`` records routed experts."""
    return any(l.moe is not None for l in profile.layers)


def check_ep(profile: Profile, ep: int, skew: str = "p95") -> None:
    """Refuse a degree the profile cannot be split at: ep < 1, an unknown skew, no MoE layer, or a
    layer whose experts ep does not divide. One line, what to do."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise PartitionError(f"expert-parallel degree {ep!r}: use a whole number >= 1 (1, 2, 4 or 8).")
    if skew not in SKEWS:
        raise PartitionError(f"unknown skew {skew!r}; use one of {', '.join(SKEWS)}.")
    if ep == 1:
        return
    if not has_experts(profile):
        raise PartitionError(f"ep {ep}: this profile records no mixture-of-experts layer (a dense model, an "
                             "estimate, or a profile made before they were recorded); use --ep 1, or profile the "
                             "model measured (without --estimate).")
    for l in profile.layers:
        if l.moe is not None and l.moe.experts % ep:
            raise PartitionError(f"ep {ep} does not divide layer {l.index} ({l.name})'s {l.moe.experts} experts; "
                                 f"use an ep that divides {l.moe.experts}.")


def ep_degrees_for(profile: Profile, dp: int, degrees: Sequence[int] = EP_DEGREES) -> list[int]:
    """The degrees of ``degrees`` that divide ``dp`` and every MoE layer's experts ([1] for a dense profile)."""
    if not has_experts(profile):
        return [1]
    return [e for e in degrees if dp % e == 0 and all(l.moe is None or l.moe.experts % e == 0 for l in profile.layers)]


def busiest_share(shape: MoeShape, ep: int, skew: str = "p95") -> float:
    """The busiest ep rank's share of the routed slots: ``1/ep`` balanced, else the p95 (p50) over the
    counted batches (1/ep where none were counted: an estimated profile)."""
    if ep <= 1:
        return 1.0
    if skew == "balanced" or not shape.loads:
        return 1.0 / ep
    return max(shape.busiest(0.95 if skew == "p95" else 0.5, ep=ep), 1.0 / ep)


def all_to_all(nbytes: float, ep: int, share: float, bandwidth: float, latency: float = EP_LATENCY) -> float:
    """Seconds of one all-to-all of ``nbytes`` per rank whose busiest receiver takes ``share`` of the
    group's slots: ``ep·share·(ep−1)/ep·B/bw + α``; 0 for one rank.

    Example:
        >>> all_to_all(1000, 4, 0.25, 1000.0, latency=0.0)  # balanced: 3/4 of the bytes leave
        0.75
    """
    return 0.0 if ep <= 1 else ep * share * (ep - 1) / ep * nbytes / bandwidth + latency


@dataclass(frozen=True)
class EpTerms:
    """One MoE layer's predicted terms at degree ep, per micro-batch (what a measured ep run is held to)."""

    index: int
    name: str
    share: float  # the busiest rank's share of the slots at the skew
    forward_compute: float  # seconds, all-to-alls left out
    backward_compute: float
    all_to_all: float  # seconds of one all-to-all (four per micro-batch)
    count_exchange: float  # seconds of the count exchange (one per micro-batch, in the forward)
    local: float  # seconds of the runner's own ops (forward + backward; MoeShape.local_forward/backward)
    skew_seconds: float  # what the skew adds to forward + backward over the balanced pricing
    param_bytes: int  # per ep rank
    activation_bytes: int


def _factors(shape: MoeShape | None, ep: int, s: float) -> tuple[float, float]:
    """(compute multiplier, parameter multiplier) of one layer."""
    if shape is None or ep <= 1:
        return 1.0, 1.0
    sig, pi = shape.expert_forward_share, shape.expert_param_share
    return (1.0 - sig) + sig * ep * s, pi / ep + (1.0 - pi)


def ep_latencies(profile: Profile, latency: float | None = None, count_latency: float | None = None) -> tuple[float, float]:
    """(α of one all-to-all, κ of one count exchange) for ``profile``: the given ones, else its
    host's measured gloo figures on a CPU profile, else ``EP_LATENCY`` (the module docstring)."""
    lat = link_latency(profile, "all_to_all", EP_LATENCY) if latency is None else latency
    return lat, link_latency(profile, "count_exchange", lat) if count_latency is None else count_latency


def _layer(l: LayerCost, ep: int, skew: str, bw: float, lat: float, kappa: float) -> LayerCost:
    shape = l.moe
    if shape is None:
        return l
    s = busiest_share(shape, ep, skew)
    kc, kp = _factors(shape, ep, s)
    a2a = all_to_all(shape.dispatch_bytes, ep, s, bw, lat)
    extra_act = int(round(max(ep * s - 1.0, 0.0) * shape.expert_activation_bytes))
    buffers = int(round(shape.dispatch_bytes * (1.0 + ep * s)))

    def b(x: int, k: float) -> int:
        return int(round(x * k))

    lf, lb = shape.local_forward, shape.local_backward
    rec = {mode: replace(r, activation_bytes=r.activation_bytes + (extra_act if mode != "full" else 0),
                         extra_backward_time=r.extra_backward_time * kc + (2 * a2a + kappa + lf if mode == "full" else 0.0))
           for mode, r in l.recompute.items()}  # fmt: skip
    split = l.split_timed
    return replace(
        l, forward_time=l.forward_time * kc + 2 * a2a + kappa + lf, backward_time=l.backward_time * kc + 2 * a2a + lb,
        forward_gap=l.forward_gap * kc, backward_gap=l.backward_gap * kc,
        forward_spread=l.forward_spread * kc, backward_spread=l.backward_spread * kc,
        backward_input_time=l.backward_input_time * kc + (2 * a2a + lb if split else 0.0),
        backward_weight_time=l.backward_weight_time * kc,
        params=b(l.params, kp), param_bytes=b(l.param_bytes, kp), grad_bytes=b(l.grad_bytes, kp),
        optimizer_bytes=b(l.optimizer_bytes, kp), activation_bytes=l.activation_bytes + extra_act,
        peak_forward_bytes=l.peak_forward_bytes + buffers, peak_backward_bytes=l.peak_backward_bytes + buffers,
        flops=l.flops * kc, recompute=rec, moe=replace(shape, ep=ep),
        weight_hold_bytes={m: v + (extra_act if m != "full" else 0) for m, v in l.weight_hold_bytes.items()},
    )  # fmt: skip


_CACHE: dict[tuple, tuple[Profile, Profile]] = {}


def at_ep(profile: Profile, ep: int, *, bandwidth: float, skew: str = "p95", latency: float | None = None,
          count_latency: float | None = None) -> Profile:  # fmt: skip
    """The profile one rank of an ep group of ``ep`` sees (the module docstring's formulas), its
    all-to-alls over ``bandwidth`` bytes/s per device, each costing ``latency`` more and the count
    exchange ``count_latency`` (by default the profile's: :func:`ep_latencies`). ep = 1 is ``profile`` itself.

    Example:
        >>> from autopipe.costs.layer_costs import LayerCost, MoeShape
        >>> moe = MoeShape(experts=4, top_k=1, hidden=8, tokens=10, dispatch_bytes=100, expert_param_share=0.5,
        ...                expert_forward_share=0.5, loads=((7, 1, 1, 1),))  # expert 0 takes 70 %
        >>> l = LayerCost(0, forward_time=1.0, backward_time=2.0, param_bytes=40, moe=moe)
        >>> p = Profile(layers=(l,))
        >>> q = at_ep(p, 2, bandwidth=1000.0, latency=0.0, count_latency=0.0).layers[0]  # rank 0: experts 0, 1: 80 %
        >>> round(q.forward_time, 6), q.param_bytes
        (1.46, 30)
        >>> round(at_ep(p, 2, bandwidth=1000.0, latency=0.0, count_latency=0.0, skew="balanced").layers[0].forward_time, 6)
        1.1
        >>> round(at_ep(p, 2, bandwidth=1000.0, latency=0.0, count_latency=0.01).layers[0].forward_time, 6)  # + κ
        1.47
        >>> timed = Profile(layers=(replace(l, moe=replace(moe, local_forward=0.02, local_backward=0.03)),))
        >>> q = at_ep(timed, 2, bandwidth=1000.0, latency=0.0, count_latency=0.0).layers[0]  # + ℓ_f, + ℓ_b
        >>> round(q.forward_time, 6), round(q.backward_time - at_ep(p, 2, bandwidth=1000.0, latency=0.0,
        ...                                                          count_latency=0.0).layers[0].backward_time, 6)
        (1.48, 0.03)
    """
    check_ep(profile, ep, skew)
    if ep == 1:
        return profile
    lat, kappa = ep_latencies(profile, latency, count_latency)
    key = (id(profile), ep, skew, bandwidth, lat, kappa)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    out = replace(profile, layers=tuple(_layer(l, ep, skew, bandwidth, lat, kappa) for l in profile.layers),
                  sequence_forward_time=0.0, sequence_backward_time=0.0)  # fmt: skip
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[key] = (profile, out)
    return out


def ep_terms(profile: Profile, ep: int, *, bandwidth: float, skew: str = "p95", latency: float | None = None,
             count_latency: float | None = None) -> list[EpTerms]:  # fmt: skip
    """Per MoE layer, the predicted compute, all-to-all and count-exchange seconds at degree ep, and
    what the skew adds over the balanced pricing (forward + backward seconds per micro-batch)."""
    check_ep(profile, ep, skew)
    latency, kappa = ep_latencies(profile, latency, count_latency)
    out = []
    for l in profile.layers:
        if l.moe is None:
            continue
        s = busiest_share(l.moe, ep, skew)
        kc, kp = _factors(l.moe, ep, s)
        a2a = all_to_all(l.moe.dispatch_bytes, ep, s, bandwidth, latency)
        kb, _ = _factors(l.moe, ep, 1.0 / ep if ep > 1 else 1.0)
        a2a_b = all_to_all(l.moe.dispatch_bytes, ep, 1.0 / ep, bandwidth, latency)
        base = l.forward_time + l.backward_time + l.forward_gap + l.backward_gap
        skew_s = base * (kc - kb) + 4 * (a2a - a2a_b)
        out.append(EpTerms(l.index, l.name, s, (l.forward_time + l.forward_gap) * kc,
                           (l.backward_time + l.backward_gap) * kc, a2a, kappa if ep > 1 else 0.0,
                           l.moe.local_forward + l.moe.local_backward if ep > 1 else 0.0, skew_s, int(round(l.param_bytes * kp)),
                           l.activation_bytes + int(round(max(ep * s - 1.0, 0.0) * l.moe.expert_activation_bytes))))  # fmt: skip
    return out
