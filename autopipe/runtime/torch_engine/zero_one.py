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
from ..training.optim import TrainConfig, optimizer_class, optimizer_options, param_groups, preallocate_

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
    """

    def __init__(self, params: Mapping[str, nn.Parameter], config: TrainConfig, group: Any) -> None:
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

    def link_grads(self) -> None:
        """Give each plain leaf the engine parameter's (reduced) gradient: a view, no copy."""
        for proxy, p in self.pairs:
            proxy.grad = local(p.grad) if p.grad is not None else None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        self.link_grads()
        return super().step(closure)

    def preallocate_(self) -> None:
        """The engine's gradients exist already; this replica's share of the state, as zeros."""
        self.link_grads()
        preallocate_(self.optim)

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
        return out


def _like(p: Any, value: Any) -> Any:
    """``value`` (a state tensor of ``p``'s local part) as a DTensor placed as ``p`` is; a scalar
    (AdamW's step) and anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != p.to_local().shape:
        return value
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
