"""ZeRO 1 on torch's engine: ``ZeroOneAdamW``, torch's ``ZeroRedundancyOptimizer`` around the
configured optimizer. Its own module, imported only under ZeRO 1 with replicas: importing
torch.distributed.optim scripts its functional optimizers (about 1 s of CPU per process)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from ..stage.build import local
from ..training.optim import TrainConfig, make_optimizer, optimizer_class, optimizer_options, param_groups, preallocate_

__all__ = ["ZeroOneAdamW"]


class ZeroOneAdamW(ZeroRedundancyOptimizer):
    """ZeRO 1: the configured optimizer (AdamW by default, the name says so; SGD or Adafactor
    alike) whose state each replica keeps for its share of the tensors only (torch's
    ``ZeroRedundancyOptimizer``); after the step each owner broadcasts its updated tensors.

    Beside DDP (ZeRO 0's engine) it steps the parameters themselves: the classic pairing. The
    parameters ``replicate`` gives (zero-bubble schedules, and tensor parallelism) are DTensors, and
    ZeroRedundancyOptimizer broadcasts plain tensors; so for those it steps plain leaves over the
    same storage (``to_local()``: a replicated DTensor's whole value, or under tp this rank's tp
    shard), whose gradients are the DTensors' local gradients: what it writes, the engine reads at
    the next forward. Under tp the data-parallel group holds one tp rank of each replica, so an
    owner's broadcast reaches the replicas holding the same shard.

    Under expert parallelism (``experts``: this rank's expert slices by name) the slices differ from
    one ep rank to the next, so they stay out of this optimizer (its owners broadcast over every
    replica): a second one, ``self.experts``, steps them right after it, at the same learning rate.
    It is another ZeroOneAdamW over ``expert_group`` (the expert data-parallel group: the dp / ep
    replicas holding the same slices, Megatron's and DeepSpeed's sharding of expert state), or, when
    that group is one rank (dp = ep), the configured optimizer itself.
    """

    def __init__(self, params: Mapping[str, nn.Parameter], config: TrainConfig, group: Any, *,
                 experts: Mapping[str, nn.Parameter] | None = None, expert_group: Any = None) -> None:  # fmt: skip
        experts = dict(experts or {})
        params = {n: p for n, p in params.items() if n not in experts}
        # DDP's parameters are plain tensors already: they step as they are
        self.pairs = [(nn.Parameter(local(p.detach()), requires_grad=p.requires_grad), p)
                      for p in params.values() if hasattr(p, "to_local")]
        proxies = iter(proxy for proxy, _ in self.pairs)
        plain = {n: next(proxies) if hasattr(p, "to_local") else p for n, p in params.items()}
        super().__init__(
            param_groups(plain, config), optimizer_class=optimizer_class(config), process_group=group,
            **optimizer_options(config, next((p.device for p in plain.values()), None)),
        )
        self.names = {id(proxy): n for n, proxy in plain.items()}
        self.experts: torch.optim.Optimizer | None = None
        self.expert_params = experts
        if experts:
            self.experts = (ZeroOneAdamW(experts, config, expert_group) if expert_group is not None
                            else make_optimizer(experts, config))

    def expert_param_groups(self) -> list[dict[str, Any]]:
        """The expert optimizer's groups (none without ep): what a caller that sets every group
        (autopipe.runtime.checkpoints.store.materialize_state_) must reach besides ``param_groups``."""
        return [] if self.experts is None else list(self.experts.param_groups)

    def link_grads(self) -> None:
        """Give each plain leaf the engine parameter's (reduced) gradient: a view, no copy."""
        for proxy, p in self.pairs:
            proxy.grad = local(p.grad) if p.grad is not None else None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.link_grads()
        out = super().step(closure)
        if self.experts is not None:
            # the LR schedule steps this optimizer's groups, and every group runs at one scheduled LR
            lr = self.param_groups[0]["lr"]
            for g in self.experts.param_groups:
                g["lr"] = lr
            self.experts.step()
        return out

    def preallocate_(self) -> None:
        """The engine's gradients exist already; this replica's share of the state, as zeros."""
        self.link_grads()
        preallocate_(self.optim)
        if isinstance(self.experts, ZeroOneAdamW):
            self.experts.preallocate_()
        elif self.experts is not None:
            preallocate_(self.experts)

    def owned_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Parameter name -> the AdamW state this replica keeps (its share). A DTensor parameter's
        state tensors are given as DTensors of its placements over the same storage, so a checkpoint
        stores a tp shard's state by its global offsets (as ZeRO 0's DTensor state is) and not one
        rank's shard under the name of the whole."""
        engine = {id(proxy): p for proxy, p in self.pairs}
        out = {}
        for proxy, state in self.optim.state.items():
            if not state:
                continue
            p = engine.get(id(proxy))
            out[self.names[id(proxy)]] = state if p is None else {k: _like(p, v) for k, v in state.items()}
        if isinstance(self.experts, ZeroOneAdamW):
            out.update(self.experts.owned_state())
        elif self.experts is not None:
            # zero.optimizer_state's plain branch, here because zero imports this module
            out.update({n: self.experts.state[p] for n, p in self.expert_params.items() if self.experts.state.get(p)})
        return out


def _like(p: Any, value: Any) -> Any:
    """``value`` (a state tensor of ``p``'s local part) as a DTensor placed as ``p`` is; a scalar
    (AdamW's step) and anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != p.to_local().shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
