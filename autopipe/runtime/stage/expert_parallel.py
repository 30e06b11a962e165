"""Expert parallelism: each MoE layer's experts shared out over an ep group of a stage's replicas.

The record (``Plan.ep``): ep divides dp; a stage's ep group is ep consecutive dp ranks; rank j of
it holds experts [j·E/ep, (j+1)·E/ep) of every MoE layer, the world is unchanged. The stage is
traced with each transformers experts call kept as one op (autopipe.graph.expert_calls), and
that op here runs:

1. dispatch: the replica's (token, top-k) slots sorted by expert, each rank's count of slots per
   expert exchanged (an all-to-all of E counts), the slots' hidden rows sent to the rank holding
   their expert by ``all_to_all_single`` with those split sizes;
2. the local experts on what arrived, by the module's own forward (transformers' configured
   implementation: grouped_mm, batched_mm or eager) on this rank's slices of the stacked
   parameters, the arrived rows numbered by local expert and weighted 1;
3. combine: the outputs sent back by the reverse all-to-all, put back in slot order, weighted by
   the router's top-k weights and summed over the top-k, as the untouched implementations do.

Both all-to-alls are torch's differentiable ones (``torch.distributed.nn.functional``): the
backward of a dispatch is the reverse all-to-all of the rows' gradients. Every replica of a stage
runs the same schedule, so the ep group meets in each MoE layer's forward and backward in the same
order; routing to no expert of a rank still sends (and back-propagates) zero rows.

Gradients: a non-expert parameter is averaged over all dp replicas by the data-parallel engine, as
without ep (ZeRO 2/3: reduce-scattered, each replica keeping its shard); the expert slices are left
out of it (DDP's ignored parameters, ``replicate``'s and ``fully_shard``'s ``ignored_params``): whole
on their ranks, their optimizer state too. An expert slice's gradient already sums what every replica of its ep group
routed to it (each replica's loss the mean over its micro-batches), so it is summed over the expert
data-parallel group (the same slice in the other ep groups) and divided by dp: the untouched
model's mean over the global batch. The gradient norm sums over the pipelines of an ep group, each
non-expert tensor counted on its ep rank 0 only.

With tensor parallelism (``--tp``): a MoE layer runs replicated over its tp ranks (its experts call
has no DTensor rule: autopipe.runtime.stage.tensor_parallel keeps it whole, the log says so), so
every tp rank of a replica routes the same tokens; the ep and expert data-parallel groups are per
(stage, tp rank), each tp rank dispatching among the replicas at its own tp rank, and an expert slice
is counted in the norm on tp rank 0 only, as everything tp replicates. The other layers of the stage
(embeddings, dense blocks, the head) are tensor-parallel as without ep.

Checkpoints (:func:`as_global`): each expert slice, and its optimizer state, is saved as a DTensor
sharded on dim 0 over a mesh of the ep group, so torch.distributed.checkpoint stores every
expert tensor once by its global offsets (the same slice in the other ep groups is the same chunk,
kept once) and loads it back into any ep degree, ep 1 included; ``export`` reads whole tensors,
and the run's own ``--export`` gathers each slice over the ep group.

Optimizer state: whole beside each slice on ZeRO 0, 2 and 3; on ZeRO 1 the slices are stepped by
an optimizer of their own, sharded over the expert data-parallel group
(autopipe.runtime.torch_engine.zero_one.ZeroOneAdamW), the rest by ZeroRedundancyOptimizer over
every replica as without ep.

Refused in one line: ep not dividing dp or the experts, a model without transformers experts
modules, DeepSpeed's engine. ``--verify`` gathers each slice's gradient over
its ep group and compares it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...costs.moe_shape import tally_expert_flops
from ...errors import AutopipeError

__all__ = ["EPLayout", "apply_expert_parallel_", "as_global", "dispatch_combine", "exchange_counts",
           "plan_expert_parallel", "reduce_expert_grads_"]


@dataclass
class EPLayout:
    """How this rank runs its MoE layers under expert parallelism."""

    ep: int
    rank: int  # this rank's place in its ep group
    group: Any  # the ep group (dispatch and combine)
    calls: dict[str, Any] = field(default_factory=dict)  # experts module name -> autopipe.graph.expert_calls.ExpertsCall
    expert_params: set[str] = field(default_factory=set)  # this rank's parameters that hold expert slices
    mesh: Any = None  # a DeviceMesh of the ep group, made on first use (as_global: checkpoints, export)

    def describe(self) -> str:
        """One line for the log: how many MoE layers, how their experts are shared out."""
        experts = sorted({c.num_experts for c in self.calls.values()})
        return (f"ep {self.ep}: {len(self.calls)} MoE layer(s), each rank of an ep group of {self.ep} replicas "
                f"holds {'/'.join(str(e // self.ep) for e in experts)} of {'/'.join(map(str, experts))} experts; "
                "tokens dispatched and combined by all-to-all")


def plan_expert_parallel(calls: Mapping[str, Any], ep: int, group: Any) -> EPLayout:
    """The layout of ``calls`` (the traced experts calls) over the ep group ``group``; one line when
    the model has none or ep does not divide a layer's experts."""
    import torch.distributed as dist

    if not calls:
        raise AutopipeError(f"--ep {ep}: the model has no MoE experts module (a transformers experts class whose "
                            "stacked weights hold the experts along dim 0); use --ep 1.")
    for name, call in calls.items():
        if call.num_experts % ep:
            raise AutopipeError(f"--ep {ep} does not divide the {call.num_experts} experts of {name}; pick an ep that "
                                f"divides {call.num_experts}.")
    return EPLayout(ep=ep, rank=dist.get_rank(group), group=group, calls=dict(calls))


def apply_expert_parallel_(build: Any, layout: EPLayout) -> None:
    """Keep this rank's slice of every expert parameter in its chunks (dim 0, the experts) and make
    the experts calls dispatch and combine over the ep group."""
    wanted = {f"{name}.{attr}": call for name, call in layout.calls.items() for attr in call.params}
    fresh: dict[int, nn.Parameter] = {}
    for name, p in list(build.params.items()):
        call = wanted.get(name)
        if call is None:
            continue
        per = call.num_experts // layout.ep
        part = p.detach()[layout.rank * per:(layout.rank + 1) * per].clone()
        fresh[id(p)] = nn.Parameter(part, requires_grad=p.requires_grad)
        build.params[name] = fresh[id(p)]
        layout.expert_params.add(name)
    for chunk in build.chunks:
        for mod in chunk.modules():
            for attr, p in list(mod._parameters.items()):
                if p is not None and id(p) in fresh:
                    mod._parameters[attr] = fresh[id(p)]
    for call in layout.calls.values():
        call.runner = _dispatching(layout)
    build.ep_layout = layout


def _dispatching(layout: EPLayout) -> Any:
    def run(call: Any, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
            state: list[torch.Tensor]) -> torch.Tensor:
        from torch._subclasses.fake_tensor import is_fake

        if hidden.device.type == "meta" or is_fake(hidden):  # a data-free pass (shapes, FLOPs; rank 0
            # alone may run it): no collective, one row per token. transformers' implementations pick
            # torch._grouped_mm off the CPU, which meta tensors run in bf16 only, so the experts' FLOPs
            # are tallied from the shapes instead (counting_expert_flops: the step log's MFU)
            tally_expert_flops(top_k_index.numel(), state)
            return hidden.new_empty(hidden.shape)
        return dispatch_combine(call, layout, hidden, top_k_index, top_k_weights, state)

    return run


def exchange_counts(counts: torch.Tensor, ep: int, group: Any) -> tuple[torch.Tensor, list[int], list[int]]:
    """The count exchange before a dispatch: each rank's ``counts`` of slots per expert (E of them)
    sent by one all-to-all, so rank r learns what every rank sends its experts. Returns (got, viewed
    ``(ep, E/ep)``: ``got[s, j]`` the slots rank s sends my expert j; the rows I send each rank; the
    rows each rank sends me). A collective of E integers and two host reads per MoE layer per forward,
    which autopipe/costs/ep.py prices as its own term (bench/bench_gloo_links.py times this function)."""
    import torch.distributed as dist

    got = torch.empty_like(counts)
    dist.all_to_all_single(got, counts, group=group)  # got[s * per + j]: slots rank s sends my expert j
    per = counts.numel() // ep
    send = counts.view(ep, per).sum(1).tolist()  # one host read per layer: the split sizes
    got = got.view(ep, per)
    return got, send, got.sum(1).tolist()


def dispatch_combine(call: Any, layout: EPLayout, hidden: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, state: list[torch.Tensor], *, exchange: Any = None,
                      all_to_all_single: Any = None) -> torch.Tensor:
    """One MoE layer's experts over the ep group (the module docstring's steps 1-3). ``exchange`` and
    ``all_to_all_single`` stand in for the collectives where given: autopipe.runtime.checks.ep_timing
    times this function's own ops on one rank with a loopback pair."""
    if all_to_all_single is None:
        from torch.distributed.nn.functional import all_to_all_single
    exchange = exchange_counts if exchange is None else exchange

    ep, group = layout.ep, layout.group
    experts = call.num_experts
    per = experts // ep
    tokens, k = top_k_index.shape
    slots = top_k_index.reshape(-1)
    order = torch.argsort(slots, stable=True)  # slots by expert, so by the rank holding it
    rows = hidden[order // k]
    counts = torch.bincount(slots, minlength=experts)
    got, send, recv = exchange(counts, ep, group)
    arrived = all_to_all_single(rows.new_empty((sum(recv), rows.shape[1])), rows, recv, send, group=group)
    local = torch.repeat_interleave(torch.arange(per, device=hidden.device).repeat(ep), got.reshape(-1))
    ones = torch.ones((local.numel(), 1), dtype=top_k_weights.dtype, device=hidden.device)
    out = call.run_local(arrived, local.unsqueeze(1), ones, state, num_experts=per)
    back = all_to_all_single(out.new_empty((rows.shape[0], out.shape[1])), out, send, recv, group=group)
    unsorted = back[torch.argsort(order)]  # (tokens * k, hidden) in (token, top-k) order
    weighted = unsorted * top_k_weights.reshape(-1, 1).to(unsorted.dtype)
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)


def reduce_expert_grads_(params: Mapping[str, nn.Parameter], names: set[str], group: Any, dp: int, comm: Any) -> None:
    """Each expert slice's gradient as the untouched model's: summed over the expert data-parallel
    ``group`` (None when dp = ep), divided by the dp replica count (see the module docstring)."""
    for name in sorted(names):
        p = params[name]
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if group is not None:
            comm.all_reduce(p.grad, group=group, where=f"expert gradient {name}")
        p.grad.div_(dp)


def as_global(layout: EPLayout, name: str, tensor: torch.Tensor, device_type: str) -> torch.Tensor:
    """``tensor`` (parameter ``name``'s value or one of its optimizer states) where it is an expert
    slice: a view of the whole expert tensor, a DTensor sharded on dim 0 over the ep group that
    shares the slice's storage (so a checkpoint loads into it in place, and ``full_tensor()``
    gathers it over the ep group). Any other tensor, and a slice's scalar state (AdamW's step), as
    it is."""
    if name not in layout.expert_params or tensor.dim() == 0:
        return tensor
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    if layout.mesh is None:  # from the existing group: no new process group, nothing collective
        layout.mesh = DeviceMesh.from_group(layout.group, device_type)
    shape = torch.Size((tensor.shape[0] * layout.ep, *tensor.shape[1:]))
    return DTensor.from_local(tensor, layout.mesh, [Shard(0)], run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())
