"""MoE experts calls kept as one op each while tracing, so a runtime can run them another way.

transformers' experts classes (``MixtralExperts``, ``Qwen3MoeExperts``...; decorated with
``use_experts_implementation``) hold every expert's weights stacked along dim 0 (``gate_up_proj``
(E, 2I, H), ``down_proj`` (E, H, I), biases (E, ...)) and take ``(hidden_states, top_k_index,
top_k_weights)``. Traced as they are, their forward becomes a sort, a histogram and grouped matmuls
over all E experts, spread over many nodes. Expert parallelism must replace exactly that region, so
inside :func:`experts_as_calls` each such call becomes one call of the op ``autopipe::experts_call``:
the graph records the three inputs and the module's stacked parameters (as ``get_attr`` nodes, so
they are the layer's parameters as before), and running the op calls the module's own forward on
them (its configured implementation: eager, grouped_mm or batched_mm), unless a runtime set another
runner for that call (:class:`ExpertsCall`; autopipe.runtime.stage.expert_parallel sets the
dispatch/combine one).

A call is found again by the number the graph holds (a key into this process's table), as for
``autopipe::opaque_function``: a layer runs in the process that traced it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["EXPERTS_OP", "ExpertsCall", "experts_as_calls", "experts_call_of", "experts_calls_of", "is_experts_module"]

_LIB = torch.library.Library("autopipe", "FRAGMENT")
_LIB.define("experts_call(int key, Tensor hidden, Tensor top_k_index, Tensor top_k_weights, Tensor[] state) -> Tensor")
EXPERTS_OP = torch.ops.autopipe.experts_call.default


@dataclass
class ExpertsCall:
    """One traced experts module: where its stacked parameters go, and what runs it."""

    module: nn.Module
    name: str  # the module's qualified name in the model
    params: tuple[str, ...]  # its own parameter attributes, in the op's state order
    num_experts: int
    forward: Callable[..., torch.Tensor]  # the class's forward (transformers' chosen implementation)
    # (call, hidden, top_k_index, top_k_weights, state) -> output; None: the module's own forward
    runner: Callable[..., torch.Tensor] | None = None

    def run_local(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                  state: list[torch.Tensor], *, num_experts: int | None = None) -> torch.Tensor:
        """The module's own forward on ``state`` (its stacked parameters, or a slice of them holding
        ``num_experts`` experts, which ``top_k_index`` then numbers from 0)."""
        for attr, t in zip(self.params, state):
            self.module._parameters[attr] = t  # the layer's tensors, as opaque calls do
        self.module.num_experts = self.num_experts if num_experts is None else num_experts
        return self.forward(self.module, hidden, top_k_index, top_k_weights)


_CALLS: dict[int, ExpertsCall] = {}
_KEYS = itertools.count()


def _eager(key: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
           state: list[torch.Tensor]) -> torch.Tensor:
    call = _CALLS[key]
    if call.runner is not None:
        return call.runner(call, hidden, top_k_index, top_k_weights, state)
    return call.run_local(hidden, top_k_index, top_k_weights, state)


@torch.library.register_fake("autopipe::experts_call", lib=_LIB)
def _fake(key: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
          state: list[torch.Tensor]) -> torch.Tensor:
    return hidden.new_empty(hidden.shape)  # every implementation returns one row per token, hidden's dtype


# At the Autograd key: the ops the runner runs record their own backward (collectives included)
_LIB.impl("experts_call", _eager, "Autograd")


def experts_call_of(node: torch.fx.Node) -> ExpertsCall | None:
    """The experts call a traced graph's ``autopipe::experts_call`` node stands for; None for any other node."""
    return _CALLS.get(node.args[0]) if node.target is EXPERTS_OP else None  # type: ignore[arg-type]


def is_experts_module(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts class whose stacked parameters all have the
    experts along dim 0 (what expert parallelism slices)."""
    experts = getattr(module, "num_experts", None)
    if not hasattr(module, "_is_expert_parallel") or not isinstance(experts, int) or experts < 1:
        return False
    own = [p for p in module._parameters.values() if p is not None]
    return bool(own) and all(p.dim() >= 2 and p.shape[0] == experts for p in own)


def experts_calls_of(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every experts module of ``model`` that :func:`experts_as_calls` keeps as one op."""
    return [(n, m) for n, m in model.named_modules() if is_experts_module(m)]


def _as_call(call: ExpertsCall, key: int) -> Callable[..., torch.Tensor]:
    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        state = [call.module._parameters[a] for a in call.params]
        return EXPERTS_OP(key, hidden_states, top_k_index, top_k_weights, state)

    return forward


@contextlib.contextmanager
def experts_as_calls(model: nn.Module) -> Iterator[dict[str, ExpertsCall]]:
    """While inside (around ``flatten``): each experts module of ``model`` runs as one
    ``autopipe::experts_call`` (an instance attribute, removed on the way out). Yields the calls by
    module name; a runtime sets their ``runner`` before the layers run."""
    calls: dict[str, ExpertsCall] = {}
    for name, module in experts_calls_of(model):
        if "forward" in module.__dict__:
            continue
        call = ExpertsCall(module, name, tuple(a for a, p in module._parameters.items() if p is not None),
                           int(module.num_experts), type(module).forward)
        key = next(_KEYS)
        _CALLS[key] = call
        module.forward = _as_call(call, key)  # type: ignore[method-assign]
        calls[name] = call
    try:
        yield calls
    finally:
        for call in calls.values():
            del call.module.forward
