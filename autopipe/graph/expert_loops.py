"""Mixture-of-experts layers whose forward loops over the experts a batch routes to, traced batched.

Such a loop (``for e in mask.sum(...).nonzero(): ... if tokens.numel() == 0: continue``) runs a number
of iterations that depends on the router's output, which torch.export cannot trace
(``GuardOnDataDependentSymNode``). transformers' own experts classes avoid it with batched
implementations (``transformers.integrations.moe``: every (token, expert) pair through its expert's
weights by one batched matmul, summed over the top-k); a few classes loop by hand and have none.

For those, while the model is traced, each instance's forward is the same arithmetic batched: every
routed slot (token × top-k) gathers its expert's weights and runs one ``bmm``, its output weighted by
the router and summed over the top-k. The result equals the loop's (the same products; sums in top-k
order instead of expert order, so equal to rounding), and so do the gradients: a parameter slice no
token chose gets none in both. The traced graph is what the job runs; the model itself is untouched
after the trace. An architecture is added here by its class name, with the batched forward of its
own arithmetic (each checked against the untouched model in tests/test_causal_lms.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["batched_expert_loops", "BATCHED"]


def _longcat_flash_experts(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """LongcatFlashExperts: routed experts are SwiGLU MLPs (``gate_up_proj``, ``down_proj``); indices at or
    past ``num_routed_experts`` are its zero-computation experts, which pass the token through."""
    tokens, k = top_k_index.shape
    x = hidden_states.repeat_interleave(k, dim=0)  # (tokens * k, hidden): one row per routed slot
    ids = top_k_index.reshape(-1)
    routed = ids < self.num_routed_experts
    if self.gate_up_proj is None:  # only zero-computation experts
        out = x
    else:
        ids_routed = ids.clamp(max=self.num_routed_experts - 1)  # a pass-through slot's product is discarded below
        gate, up = torch.bmm(self.gate_up_proj[ids_routed], x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        mlp = torch.bmm(self.down_proj[ids_routed], (self.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
        out = torch.where(routed.unsqueeze(-1), mlp, self.identity_expert(x))
    weighted = out * top_k_weights.reshape(-1, 1).to(out.dtype)
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def _dbrx_experts(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """DbrxExperts: expert e is a GLU over rows [e·ffn, (e+1)·ffn) of the stacked ``mlp.w1``, ``mlp.v1``
    and ``mlp.w2`` ((experts·ffn, hidden) each): ``(act(x w1ᵀ) * x v1ᵀ) w2``. ``hidden_states`` is
    (batch, seq, hidden), the router's indices and weights (batch·seq, top-k)."""
    batch = hidden_states.shape[0]
    tokens, k = top_k_index.shape
    x = hidden_states.reshape(-1, self.hidden_size).repeat_interleave(k, dim=0).unsqueeze(-1)  # (slots, hidden, 1)
    ids = top_k_index.reshape(-1)
    split = (-1, self.ffn_hidden_size, self.hidden_size)
    w1, v1, w2 = (getattr(self.mlp, name).view(split)[ids] for name in ("w1", "v1", "w2"))  # (slots, ffn, hidden)
    inner = self.mlp.activation_fn(torch.bmm(w1, x).squeeze(-1)) * torch.bmm(v1, x).squeeze(-1)  # (slots, ffn)
    out = torch.bmm(inner.unsqueeze(1), w2).squeeze(1)  # (slots, hidden)
    weighted = out * top_k_weights.reshape(-1, 1).to(out.dtype)
    return weighted.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype).view(batch, -1, self.hidden_size)


# class name -> its forward, batched (same signature as the class's own)
BATCHED: dict[str, Callable[..., torch.Tensor]] = {"LongcatFlashExperts": _longcat_flash_experts,
                                                   "DbrxExperts": _dbrx_experts}


@contextlib.contextmanager
def batched_expert_loops(model: nn.Module) -> Iterator[list[str]]:
    """While inside: every submodule of a class in :data:`BATCHED` runs its batched forward (an instance
    attribute, removed on the way out). Yields the names of the classes it replaced."""
    swapped: list[nn.Module] = []
    names: list[str] = []
    for module in model.modules():
        batched = BATCHED.get(type(module).__name__)
        if batched is not None and "forward" not in module.__dict__:
            module.forward = batched.__get__(module)  # type: ignore[method-assign]
            swapped.append(module)
            names += [type(module).__name__] if type(module).__name__ not in names else []
    try:
        yield names
    finally:
        for module in swapped:
            del module.forward
