"""What the ep runner's own ops cost one rank, timed on the profiling host: the term autopipe.costs.ep
adds to a MoE layer at ep > 1 beside its experts' compute and its all-to-alls.

Under expert parallelism each MoE layer's experts call runs autopipe.runtime.stage.expert_parallel's
``dispatch_combine``: the slots sorted by expert, their hidden rows gathered, the split sizes counted
and expanded, and after the combine the rows put back in slot order, weighted and summed over the
top-k; the backward of each (index scatters, a sort's inverse). None of that runs at ep 1, where the
experts module takes the tokens as they are, so a profile timed at ep 1 does not hold it; on the
bench's tiny Mixtral it was ~12 ms of a 241 ms ep 2 step that its plan left out (bench/results/
moe-ep-step.md, 1.12x its p95 prediction).

So, per distinct MoE shape of a profile (tokens, top-k, hidden, experts, dtype), the function itself
runs here on one rank, forward then backward, with its collectives replaced by a loopback (the count
exchange returns this rank's own counts, the all-to-alls their input: an ep group of one) and its
local experts by the identity: what is left is exactly the runner's own ops at the layer's slot
count, and those are the same at every degree (each rank gathers and puts back its own T·k slots;
what arrives from the others is the experts' compute, priced by their FLOPs share, and the
all-to-alls', priced from the links). Timed at a job rank's threads, as the profile's layers are.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from ...costs.devices import rank_threads
from ...costs.layer_costs import MoeShape, Profile
from ...costs.measure import time_layer
from ..stage.expert_parallel import EPLayout, dispatch_combine

__all__ = ["loopback_all_to_all", "loopback_exchange", "time_ep_local", "with_ep_local_timed"]


def loopback_exchange(counts: torch.Tensor, ep: int, group: Any) -> tuple[torch.Tensor, list[int], list[int]]:
    """The count exchange of an ep group of one: this rank sends all its slots to itself."""
    total = int(counts.sum())
    return counts.view(1, -1), [total], [total]


def loopback_all_to_all(output: torch.Tensor, input: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
    """An all-to-all of a group of one: what is sent arrives (its copy is the links' term, not this one)."""
    return input


class _Runner(torch.nn.Module):
    """``dispatch_combine`` on a loopback group of one, its experts the identity (a module, so the
    profile's own timer runs it as it runs a layer: fresh forward, backward to the inputs)."""

    def __init__(self, experts: int, index: torch.Tensor) -> None:
        super().__init__()
        self.index = index
        self.call = SimpleNamespace(num_experts=experts,
                                    run_local=lambda arrived, *_a, **_k: arrived)  # fmt: skip
        self.layout = EPLayout(ep=1, rank=0, group=None)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # a layer's one packed input
        hidden, weights = x
        return dispatch_combine(self.call, self.layout, hidden, self.index, weights, [],
                                exchange=loopback_exchange, all_to_all_single=loopback_all_to_all)  # fmt: skip


def time_ep_local(shape: MoeShape, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                  warmup: int = 2, repeats: int = 5, seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds of the ep runner's own ops for one micro-batch of a layer of
    ``shape`` (its tokens, top-k, hidden and experts), the slots drawn from its routing's mean shares."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    tokens, k = max(shape.tokens, 1), max(shape.top_k, 1)
    shares = torch.tensor(shape.shares(), dtype=torch.float64)
    # k distinct experts per token, as a router's top-k picks them, in proportion to the counted loads
    index = torch.multinomial(shares.clamp_min(1e-9).expand(tokens, -1), k, generator=gen).to(dev)
    hidden = torch.randn(tokens, shape.hidden, generator=gen).to(dev, dtype).requires_grad_(True)
    weights = torch.rand(tokens, k, generator=gen).to(dev, dtype).requires_grad_(True)
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(rank_threads())
    try:
        t = time_layer(_Runner(shape.experts, index), (hidden, weights), device=dev, warmup=warmup, repeats=repeats)
    finally:
        torch.set_num_threads(threads)
    return t.forward, t.backward


def with_ep_local_timed(profile: Profile, *, device: str | torch.device = "cpu", warmup: int = 2,
                        repeats: int = 5) -> Profile:  # fmt: skip
    """``profile`` with each MoE layer's ``local_forward``/``local_backward`` timed (one timing per
    distinct shape and dtype); a profile without MoE layers as it is."""
    seen: dict[tuple[int, int, int, int, int], tuple[float, float]] = {}
    layers = []
    for l in profile.layers:
        m = l.moe
        if m is None:
            layers.append(l)
            continue
        elem = m.dispatch_bytes // max(m.tokens * m.top_k * m.hidden, 1) or 4
        key = (m.tokens, m.top_k, m.hidden, m.experts, elem)
        if key not in seen:
            dtype = {2: torch.bfloat16, 8: torch.float64}.get(elem, torch.float32)
            seen[key] = time_ep_local(m, dtype=dtype, device=device, warmup=warmup, repeats=repeats)
        f, b = seen[key]
        layers.append(replace(l, moe=replace(m, local_forward=f, local_backward=b)))
    return profile.with_layers(layers)
