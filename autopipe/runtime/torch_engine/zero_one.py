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
    parameters ``replicate`` gives (zero-bubble schedules) are replicated DTensors, and
    ZeroRedundancyOptimizer broadcasts plain tensors; so for those it steps plain leaves over the
    same storage (``to_local()`` of a replicated DTensor is its whole value), whose gradients are
    the DTensors' local gradients: what it writes, the engine reads at the next forward.
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
        """Parameter name -> the AdamW state this replica keeps (its share)."""
        return {self.names[id(p)]: s for p, s in self.optim.state.items() if s}
