"""Tensor parallelism priced per layer: the profile one tp rank sees at degree t. No torch.

Each layer's :class:`~autopipe.costs.layer_costs.TpShape` (found on the traced layer by
autopipe.costs.tp_shape) says which share of it tensor parallelism divides and which collectives it
adds. :func:`at_tp` turns a Profile into the profile of one rank of a tp group of ``t`` (Megatron's
scheme, as torch's DTensor colwise/rowwise pairs run it), so ``partition`` and the cluster search
run unchanged on it and the plan records ``tp=t``. Every figure below is per micro-batch.

Compute. A layer's forward seconds ``f`` split into ``f·σ_f`` over sharded data (the matmuls over
sharded weights and the ops on their sharded outputs: attention heads, the MLP's activation) and
the rest ``f·(1−σ_f)`` (norms, residual adds, rotary tables, softmax outside heads)::

    f_t = f·σ_f / t + f·(1−σ_f)·ρ          ρ = 1/t under sequence parallelism in a layer with a
                                            colwise→rowwise pair, else 1

and the backward alike with its share σ_b. Parameters are sharded by the same division, so a
measured matmul's time is divided exactly t ways: the FLOPs divide; a launch overhead per op does
not, which this leaves out (a small tp rank's matmuls run below the roofline's peak: an optimistic
estimate at t = 8 of small models, stated in bench/results/search.md).

Collectives (Megatron-LM, Shoeybi et al. 2019, §3: "two all-reduces in the forward and two in the
backward" per transformer block). Forward: one all-reduce of the activation (b·s·h·bytes) after each
rowwise matmul (and after a vocab-sharded embedding); backward: one all-reduce of the input gradient
per distinct colwise input (the gradient of a replicated input is a partial sum on each rank); a
colwise output no rowwise matmul consumes (the logits of ``colwise_gather_output``) is all-gathered
whole in forward, its backward a local split. Each is a ring over the t ranks of one node::

    all_reduce(B) = 2(t−1)/t · B / bw + α        all_gather(B) = (t−1)/t · B / bw + α

with bw the node's link (bytes/s per device, one way: autopipe/cluster/topology.py's LINKS) and α a
per-collective latency: ``TP_LATENCY`` (NVLink's) on a GPU; on a CPU profile its host's own gloo
figures, measured once per host (``DeviceInfo.links``, autopipe/runtime/checks/links.py: α ≈ 0.5 ms
for an all-reduce, 0.3 ms for an all-gather on a 2026 Xeon, bench/results/gloo-links.md), each
collective its own α. Under sequence parallelism each all-reduce becomes a reduce-scatter plus an
all-gather of the same tensor: the same 2(t−1)/t·B bytes per link, two latencies, split between the
passes by the side of the layer it sits on (a rowwise output leaving as sequence pieces: reduce-scatter
forward, all-gather of its gradient backward; a colwise input arriving as pieces: all-gather forward,
reduce-scatter of its partial gradient backward). The first layer takes the data whole; the last
gathers its pieces whole on entry (one all-gather) and all-reduces its colwise inputs' gradients whole.
Each layer's count is what it issues, per pass (tests/test_tensor_parallel.py counts them on a fake
process group), but for the case below. The collectives
sit on the layer's critical path (the next op needs their result), so they are added to the layer's
forward and backward seconds; the zero-bubble split charges the backward's to the input-gradient pass.

Memory. Parameters, gradients and optimizer state: ``p_t = p·(π/t + 1−π)`` with π the sharded
weights' share. Activations kept for backward: ``a_t = a·(κ/t + 1−κ)`` with κ the sharded
intermediates' share (the replicated ones — each block's input, the norms' outputs — are whole on
every rank); under sequence parallelism the replicated ones are sharded on the sequence too,
``a_t = a/t``. Full recompute keeps only the layer's input (replicated, or sequence-sharded under
SP); its extra backward is the forward again, collectives included; selective recompute re-runs
only the attention core, which is sharded by heads (÷t). The tensor leaving a layer (what crosses a
pipeline cut) is whole on every tp rank, or 1/t of it under SP. Tied parameters divide as the
layers holding them do.

Timed. The shares divide a layer's seconds as its FLOPs divide, which a GPU's large matmuls come near
and a CPU's small ones do not: DTensor dispatches every op of a tp layer in Python (12-18 µs a small
op, ~120 µs a matmul on a 2026 Xeon, bench/results/tp.md), so a Llama block of hidden 256 at tp 2 took
as long as at tp 1 where the shares said 0.6 of it. Where the profile's layer records a ratio timed
at the degree asked (``TpShape.timed``: the layer run as the runtime runs it at tp on a fake process
group in one process, its collectives free, over the same layer plain, timed beside each other:
autopipe.runtime.checks.tp_timing, what ``convert --tp`` does on a CPU), the compute is that ratio
of the layer's seconds instead, the collectives priced as below on top::

    f_t = f·r_f + collectives        b_t = b·r_b + collectives

MoE layers (a layer with a MoeShape). Their experts call has no DTensor rule (grouped_mm, or the eager
loop's data-dependent ``nonzero``), so autopipe.runtime.stage.tensor_parallel runs it whole on each tp
rank's local tensors and the rest of the block on DTensors: the attention sharded by heads, the
experts' weights whole. The traced shape says so already (the experts' stacked weights are no
colwise/rowwise matmul: π, σ and the collectives are the attention's), and it is priced by it. Under
sequence parallelism such a block gathers its sequence input whole on entry (the router and experts
read every token) and runs as without it inside (ρ = 1, activations by κ), then cuts its output to
pieces, whose gradient is gathered whole in backward. Under expert parallelism (``expert_parallel``)
the experts call dispatches plain tensors over the ep group and the whole layer runs replicated over
tp: whole compute, whole memory, no collectives, a ratio timed at t not applied; under sequence
parallelism it gathers its sequence input whole in forward and its output's gradient whole in
backward (one all-gather each, of the residual stream's bytes: ``TpShape.sequence_bytes``).

Which weights are sharded follows the runtime's plan (autopipe.graph.tp_plan.whole_weights: the
model's HF tp_plan or the derived one, tied tensors agreeing on one placement), so a derived plan's
output matmul kept whole (GPT-2's head) and the embedding tied to it are priced whole, with no
collectives. Not priced as run (counted per layer by torch's CommDebugMode on a fake process group:
tests/test_tensor_parallel.py): GPT-2's fused-qkv blocks issue 3 forward and 4 backward where 2 and 2
are priced.

t = 1 returns the profile itself (the same object): today's numbers, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from ..errors import PartitionError
from .layer_costs import LayerCost, Profile, RecomputeCost, TpShape
from .links import link_latency

__all__ = ["TP_DEGREES", "TP_LATENCY", "TpTerms", "at_tp", "tp_terms", "tp_degrees_for", "check_tp",
           "ring_all_reduce", "ring_all_gather", "tp_latencies", "with_tp_timed"]  # fmt: skip

TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
# Per-collective latency: NCCL's intra-node ring over NVLink reaches its bus bandwidth from about a
# megabyte; below that a collective costs ~10 µs (nccl-tests all_reduce_perf on DGX H100, 8 GPUs).
TP_LATENCY = 10e-6


def ring_all_reduce(nbytes: float, t: int, bandwidth: float, latency: float = TP_LATENCY) -> float:
    """``2(t−1)/t · B / bw + α`` seconds; 0 for one rank."""
    return 0.0 if t <= 1 else 2.0 * (t - 1) / t * nbytes / bandwidth + latency


def ring_all_gather(nbytes: float, t: int, bandwidth: float, latency: float = TP_LATENCY) -> float:
    """``(t−1)/t · B / bw + α`` seconds for gathering a whole tensor of ``B`` bytes; 0 for one rank."""
    return 0.0 if t <= 1 else (t - 1) / t * nbytes / bandwidth + latency


@dataclass(frozen=True)
class TpTerms:
    """One layer's predicted terms at degree t, per micro-batch (what a measured tp run is held to)."""

    index: int
    name: str
    forward_compute: float  # seconds, collectives left out
    backward_compute: float
    forward_collective: float  # seconds of the collectives tp adds
    backward_collective: float
    forward_bytes: int  # bytes of the whole tensors those collectives reduce or gather
    backward_bytes: int
    forward_collectives: int  # how many
    backward_collectives: int
    param_bytes: int  # per tp rank
    activation_bytes: int


def check_tp(profile: Profile, t: int) -> None:
    """Refuse a degree the profile cannot be split at: t < 1, no tp shapes recorded, no weight tp
    shards, or a layer whose sharded dimensions (features, attention heads) t does not divide. One
    line, what to do."""
    if not isinstance(t, int) or t < 1:
        raise PartitionError(f"tensor-parallel degree {t!r}: use a whole number >= 1 (1, 2, 4 or 8).")
    if t == 1:
        return
    if not any(l.tp is not None for l in profile.layers):
        raise PartitionError(f"tp {t}: this profile records no tensor-parallel shapes (made before they were, "
                             "by convert without --tp, or from plain numbers); profile the model again (autopipe "
                             "profile records them), or use --tp 1.")
    if not any(l.tp is not None and l.tp.param_share > 0 for l in profile.layers):
        # every weight kept whole (no colwise→rowwise pair, no HF tp_plan entry): each tp rank would run
        # the whole model, dividing nothing
        raise PartitionError(f"tp {t}: tensor parallelism shards no weight of this model (no colwise→rowwise "
                             "matmul pair and no HF tp_plan entry; every layer would run whole on each tp rank); "
                             "use --tp 1 and replicas (--dp) or stages instead.")
    for l in profile.layers:
        if l.tp is not None and l.tp.divisor and l.tp.divisor % t:
            raise PartitionError(f"tp {t} does not divide layer {l.index} ({l.name})'s sharded dimensions "
                                 f"({l.tp.divisor} features/heads); use a tp that divides {l.tp.divisor}.")


def tp_degrees_for(profile: Profile, gpus_per_node: int, degrees: Sequence[int] = TP_DEGREES) -> list[int]:
    """The degrees of ``degrees`` that divide a node's devices and every layer's sharded dimensions."""
    out = []
    for t in degrees:
        if gpus_per_node % t:
            continue
        try:
            check_tp(profile, t)
        except PartitionError:
            continue
        out.append(t)
    return out


def _as_run(l: LayerCost, ep: bool = False) -> TpShape | None:
    """The layer's TpShape as the runtime runs it: None (replicated, priced whole) for a MoE layer
    under expert parallelism (``ep``)."""
    return None if ep and l.moe is not None else l.tp


def _sp_inside(l: LayerCost, sp: bool, ep: bool) -> bool:
    """Whether the layer runs sequence parallel inside: not a MoE block run on DTensors, which gathers
    its sequence input whole on entry and runs as without SP (its router and experts read every token)."""
    return sp and not (l.moe is not None and not ep)


def _run_factors(l: LayerCost, t: int, sp: bool, ep: bool) -> tuple[TpShape | None, tuple[float, float, float, float, float]]:
    """The layer's shape as run (:func:`_as_run`) and its :func:`_factors` at t, sequence parallel as it runs inside."""
    shape = _as_run(l, ep)
    return shape, _factors(shape, t, _sp_inside(l, sp, ep))


def _factors(shape: TpShape | None, t: int, sp: bool) -> tuple[float, float, float, float, float]:
    """(forward, backward, param, activation, replicated-activation) multipliers of one layer at t."""
    if shape is None or t == 1 or not shape.divisor:
        return 1.0, 1.0, 1.0, 1.0, 1.0
    rho = 1.0 / t if sp and shape.pairs else 1.0
    fwd = shape.split_forward / t + (1.0 - shape.split_forward) * rho
    bwd = shape.split_backward / t + (1.0 - shape.split_backward) * rho
    par = shape.param_share / t + (1.0 - shape.param_share)
    act = 1.0 / t if sp and shape.pairs else shape.activation_share / t + (1.0 - shape.activation_share)
    return fwd, bwd, par, act, rho


def _seconds_factors(shape: TpShape | None, t: int, sp: bool, kf: float, kb: float) -> tuple[float, float]:
    """(forward, backward) multipliers of a layer's seconds at t: the ratios timed on the host where
    the profile records them (DTensor's dispatch included), else the shares' ``kf``, ``kb``."""
    timed = shape.timed_at(t, sp) if shape is not None and t > 1 else None
    return timed if timed is not None else (kf, kb)


def tp_latencies(profile: Profile, latency: float | None = None) -> tuple[float, float, float]:
    """(α of an all-reduce, of an all-gather, of a reduce-scatter) for ``profile``: ``latency`` for
    all three where given, else its host's measured gloo figures on a CPU profile, else ``TP_LATENCY``."""
    if latency is not None:
        return latency, latency, latency
    return (link_latency(profile, "all_reduce", TP_LATENCY), link_latency(profile, "all_gather", TP_LATENCY),
            link_latency(profile, "reduce_scatter", TP_LATENCY))  # fmt: skip


@dataclass(frozen=True)
class _Sides:
    """Where a layer sits in the sequence under sequence parallelism (the runtime's rule,
    autopipe.runtime.stage.tensor_parallel): the first layer takes the data whole and sends its
    output as sequence pieces; the last takes pieces, gathers them whole on entry and gives the loss
    whole outputs; every other layer takes and sends pieces. ``in_bytes``: its input activation whole."""

    in_pieces: bool
    out_pieces: bool
    in_bytes: int


def _sequence_bytes(l: LayerCost) -> int:
    """The bytes of the layer's outputs that travel as sequence pieces (its whole output where the
    profile recorded no split)."""
    return l.tp.sequence_bytes if l.tp is not None and l.tp.sequence_bytes else l.output_bytes


def _sides(profile: Profile, i: int) -> _Sides:
    n = len(profile.layers)
    in_bytes = _sequence_bytes(profile.layers[i - 1]) if i > 0 else profile.input_bytes
    return _Sides(in_pieces=i > 0, out_pieces=i < n - 1, in_bytes=in_bytes)


def _collectives(l: LayerCost, t: int, sp: bool, bw: float, lat: tuple[float, float, float],
                 sides: _Sides, ep: bool = False) -> tuple[float, float, int, int, int, int]:  # fmt: skip
    """(forward s, backward s, forward bytes, backward bytes, forward count, backward count) of the
    collectives layer ``l`` adds at degree t, as the runtime issues them (counted per layer on a fake
    process group: tests/test_tensor_parallel.py).

    Without sequence parallelism: an all-reduce per rowwise output (forward) and per distinct colwise
    input (backward), an all-gather per gathered colwise output. Under it each all-reduce splits by
    which side of the layer it sits on: a rowwise output leaving as sequence pieces is reduce-scattered
    in forward, its gradient all-gathered in backward; a colwise input arriving as pieces is
    all-gathered in forward, its partial gradient reduce-scattered in backward (the same 2(t−1)/t·B
    bytes per link as the all-reduce, two latencies). The last layer gathers its pieces whole on entry
    (one more all-gather forward), so its colwise inputs' gradients are all-reduced whole. A MoE block
    does the same (its router and experts read every token) and, its output leaving as pieces, gathers
    that output's gradient whole in backward. A layer run replicated (a MoE block under expert
    parallelism) gathers its sequence input whole in forward and its output's gradient in backward,
    nothing else."""
    ar, ag, rs = lat
    shape = _as_run(l, ep)
    whole_inside = sp and not _sp_inside(l, sp, ep)
    if t == 1 or (shape is None and not (sp and l.moe is not None)):
        return 0.0, 0.0, 0, 0, 0, 0
    fwd: list[tuple[str, int]] = []  # (kind, whole bytes)
    bwd: list[tuple[str, int]] = []
    if shape is None:  # replicated over tp, under sequence parallelism
        if sides.in_pieces:
            fwd.append(("ag", sides.in_bytes))
        if sides.out_pieces:
            bwd.append(("ag", _sequence_bytes(l)))
    else:
        for b in shape.allreduce_forward:
            if sp and sides.out_pieces and not whole_inside:
                fwd.append(("rs", b))
                bwd.append(("ag", b))
            else:
                fwd.append(("ar", b))
        # the last layer, and a MoE block: pieces made whole on entry
        gathered = sp and sides.in_pieces and (not sides.out_pieces or whole_inside)
        if gathered:
            fwd.append(("ag", sides.in_bytes))
        for b in shape.allreduce_backward:
            if sp and sides.in_pieces and not gathered:
                fwd.append(("ag", b))
                bwd.append(("rs", b))
            else:
                bwd.append(("ar", b))
        fwd += [("ag", b) for b in shape.gather_forward]
        if whole_inside and sides.out_pieces:  # its whole output cut to pieces: the gradient gathered back
            bwd.append(("ag", _sequence_bytes(l)))

    def seconds(ops: list[tuple[str, int]]) -> float:
        return sum(ring_all_reduce(b, t, bw, ar) if k == "ar" else ring_all_gather(b, t, bw, ag if k == "ag" else rs)
                   for k, b in ops)  # a reduce-scatter moves what an all-gather does, the other way

    return (seconds(fwd), seconds(bwd), sum(b for _, b in fwd), sum(b for _, b in bwd), len(fwd), len(bwd))


def _layer(l: LayerCost, t: int, sp: bool, bw: float, lat: tuple[float, float, float], sides: _Sides,
           ep: bool = False) -> LayerCost:
    shape, (kf, kb, kp, ka, rho) = _run_factors(l, t, sp, ep)
    sf, sb = _seconds_factors(shape, t, sp, kf, kb)  # FLOPs still divide by the shares
    cf, cb, *_ = _collectives(l, t, sp, bw, lat, sides, ep)

    def b(x: int, k: float) -> int:
        return int(round(x * k))

    rec = {}
    for mode, r in l.recompute.items():
        if mode == "full":  # the input alone is kept; the forward runs again, its collectives too
            rec[mode] = RecomputeCost(b(r.activation_bytes, rho), r.extra_backward_time * sf + cf)
        else:  # selective: the attention core again, sharded by heads
            sel = 1.0 / t if shape is not None and shape.divisor else 1.0
            rec[mode] = RecomputeCost(b(r.activation_bytes, ka), r.extra_backward_time * sel)
    hold = {m: b(v, rho if m == "full" else ka) for m, v in l.weight_hold_bytes.items()}
    split = l.split_timed
    return replace(
        l, forward_time=l.forward_time * sf + cf, backward_time=l.backward_time * sb + cb,
        forward_gap=l.forward_gap * sf, backward_gap=l.backward_gap * sb,
        forward_spread=l.forward_spread * sf, backward_spread=l.backward_spread * sb,
        backward_input_time=l.backward_input_time * sb + (cb if split else 0.0),
        backward_weight_time=l.backward_weight_time * sb,
        params=b(l.params, kp), param_bytes=b(l.param_bytes, kp), grad_bytes=b(l.grad_bytes, kp),
        optimizer_bytes=b(l.optimizer_bytes, kp), activation_bytes=b(l.activation_bytes, ka),
        peak_forward_bytes=b(l.peak_forward_bytes, ka), peak_backward_bytes=b(l.peak_backward_bytes, ka),
        output_bytes=b(l.output_bytes, 1.0 / t if sp else 1.0), flops=l.flops * kf,
        recompute=rec, weight_hold_bytes=hold,
    )  # fmt: skip


_CACHE: dict[tuple, tuple[Profile, Profile]] = {}


def at_tp(profile: Profile, t: int, *, sequence_parallel: bool = False, bandwidth: float,
          latency: float | None = None, expert_parallel: bool = False) -> Profile:  # fmt: skip
    """The profile one rank of a tp group of ``t`` sees (the module docstring's formulas), its
    collectives over ``bandwidth`` bytes/s per device (the node's link), each costing ``latency``
    more (by default the profile's: :func:`tp_latencies`). ``expert_parallel``: the plan shards the
    experts over an ep group too, and its MoE layers run replicated over tp. t = 1 is ``profile`` itself.

    Example:
        >>> from autopipe.costs.layer_costs import LayerCost, TpShape
        >>> shape = TpShape(split_forward=0.8, split_backward=0.8, param_share=1.0, activation_share=0.5,
        ...                 allreduce_forward=(100,), allreduce_backward=(100,), divisor=64)
        >>> l = LayerCost(0, forward_time=1.0, backward_time=2.0, param_bytes=40, activation_bytes=80, tp=shape)
        >>> q = at_tp(Profile(layers=(l,)), 2, bandwidth=100.0, latency=0.0).layers[0]
        >>> round(q.forward_time, 6), round(q.backward_time, 6), q.param_bytes, q.activation_bytes
        (1.6, 2.2, 20, 60)

        Timed at tp 2 on the host (forward 0.9, backward 0.7 of tp 1's), the compute is those ratios:

        >>> timed = replace(l, tp=replace(shape, timed=((2, False, 0.9, 0.7),)))
        >>> q = at_tp(Profile(layers=(timed,)), 2, bandwidth=100.0, latency=0.0).layers[0]
        >>> round(q.forward_time, 6), round(q.backward_time, 6)
        (1.9, 2.4)
    """
    check_tp(profile, t)
    if t == 1:
        return profile
    if sequence_parallel and not any(l.tp is not None and l.tp.pairs for l in profile.layers):
        raise PartitionError("sequence parallelism needs a layer with a colwise→rowwise pair; this profile has none.")
    lat = tp_latencies(profile, latency)
    key = (id(profile), t, sequence_parallel, bandwidth, lat, expert_parallel)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is profile:
        return hit[1]
    ep = expert_parallel
    layers = tuple(_layer(l, t, sequence_parallel, bandwidth, lat, _sides(profile, i), ep)
                   for i, l in enumerate(profile.layers))
    tied_k: dict[str, float] = {}
    for l in profile.layers:
        kp = _run_factors(l, t, sequence_parallel, ep)[1][2]
        for name in l.tied:
            tied_k[name] = min(tied_k.get(name, 1.0), kp)
    out = replace(
        profile, layers=layers,
        tied_static_bytes={n: int(round(v * tied_k.get(n, 1.0))) for n, v in profile.tied_static_bytes.items()},
        tied_grad_time={n: v * tied_k.get(n, 1.0) for n, v in profile.tied_grad_time.items()},
        input_bytes=int(round(profile.input_bytes / t)) if sequence_parallel else profile.input_bytes,
        sequence_forward_time=0.0, sequence_backward_time=0.0,
    )  # fmt: skip
    if len(_CACHE) > 64:
        _CACHE.clear()
    _CACHE[key] = (profile, out)
    return out


def tp_terms(profile: Profile, t: int, *, sequence_parallel: bool = False, bandwidth: float,
             latency: float | None = None, expert_parallel: bool = False) -> list[TpTerms]:  # fmt: skip
    """Per layer, the predicted forward/backward compute and collective seconds and bytes at degree t
    (what a bench holds a measured tp run's per-layer figures to). The sums of compute + collective
    are :func:`at_tp`'s forward and backward times."""
    check_tp(profile, t)
    lat = tp_latencies(profile, latency)
    out = []
    for i, l in enumerate(profile.layers):
        shape, (kf, kb, kp, ka, _) = _run_factors(l, t, sequence_parallel, expert_parallel)
        sf, sb = _seconds_factors(shape, t, sequence_parallel, kf, kb)
        cf, cb, fb, bb, nf, nb = _collectives(l, t, sequence_parallel, bandwidth, lat, _sides(profile, i),
                                              expert_parallel)
        out.append(TpTerms(l.index, l.name, (l.forward_time + l.forward_gap) * sf, (l.backward_time + l.backward_gap) * sb,
                           cf, cb, fb, bb, nf, nb, int(round(l.param_bytes * kp)), int(round(l.activation_bytes * ka))))  # fmt: skip
    return out


def with_tp_timed(profile: Profile, t: int, ratios: Sequence[tuple[float, float]], *,
                  sequence_parallel: bool = False) -> Profile:  # fmt: skip
    """``profile`` with each layer's TpShape recording the (forward, backward) ratios timed at degree
    ``t`` (autopipe.runtime.checks.tp_timing), in the layers' order; any earlier ratios at the same
    degree and sequence parallelism are replaced. A layer with no TpShape is priced replicated as before.

    Example:
        >>> from autopipe.costs.layer_costs import LayerCost, TpShape
        >>> p = Profile(layers=(LayerCost(0, forward_time=1.0, tp=TpShape(divisor=4)), LayerCost(1, forward_time=1.0)))
        >>> [l.tp.timed if l.tp else None for l in with_tp_timed(p, 2, [(0.9, 0.8), (1.0, 1.0)]).layers]
        [((2, False, 0.9, 0.8),), None]
    """
    if len(ratios) != len(profile.layers):
        raise PartitionError(f"{len(ratios)} timed ratios for a profile of {len(profile.layers)} layers; time the "
                             "sequence this profile was made of.")  # fmt: skip
    layers = []
    for l, (f, b) in zip(profile.layers, ratios):
        if l.tp is not None:
            kept = tuple(e for e in l.tp.timed if (e[0], e[1]) != (t, sequence_parallel))
            l = replace(l, tp=replace(l.tp, timed=(*kept, (t, sequence_parallel, float(f), float(b)))))
        layers.append(l)
    return profile.with_layers(layers)
