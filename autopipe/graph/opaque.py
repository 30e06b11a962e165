"""Custom autograd.Functions kept as one opaque call each, so their hand-written backward runs.

torch.export (non-strict) runs a Function's forward and keeps only the ops it ran: the backward is
lost, and a forward that runs under ``torch.no_grad()`` because its backward recomputes it
(Reformer's reversible layers) then leaves a graph whose loss reaches no parameter. While tracing,
each user Function call becomes one call of the op ``autopipe::opaque_function`` instead: the
graph records the call with its tensors and the parameters and buffers of the modules it was
handed, and running the op calls the Function itself, so autograd records its own backward.

A call is found again by the number the graph holds (a key into this process's table): a layer
runs in the process that traced it, as every rank of a job traces its own model.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["opaque_functions", "OPAQUE_OP"]

_LIB = torch.library.Library("autopipe", "FRAGMENT")
_LIB.define("opaque_function(int key, Tensor[] tensors, Tensor[] state) -> Tensor[]")
OPAQUE_OP = torch.ops.autopipe.opaque_function.default


@dataclass
class _Call:
    """One traced Function call: how to rebuild its arguments, and where the modules' tensors sit."""

    cls: type
    spec: pytree.TreeSpec  # of (args, kwargs), tensors as _TENSOR
    leaves: list[Any]  # the non-tensor leaves, tensors as _TENSOR
    slots: list[tuple[dict[str, Any], str, int]]  # (module table, name, index into state)
    out_spec: pytree.TreeSpec | None = None
    out_leaves: list[Any] = field(default_factory=list)


_CALLS: dict[int, _Call] = {}
_KEYS = itertools.count()
_inside = threading.local()
_TENSOR = object()  # where a tensor goes among a call's leaves


def _run(call: _Call, tensors: list[torch.Tensor], state: list[torch.Tensor]) -> Any:
    # The modules must hold the tensors the layer passes, through the backward too (Reformer's
    # recomputes with its modules there): on a job's rank the layer's tensors are the rank's own.
    for table, name, idx in call.slots:
        if table[name] is not state[idx]:
            table[name] = state[idx]
    given = iter(tensors)
    leaves = [next(given) if leaf is _TENSOR else leaf for leaf in call.leaves]
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    _inside.depth = getattr(_inside, "depth", 0) + 1
    try:
        return call.cls.apply(*args, **kwargs)
    finally:
        _inside.depth -= 1


def _outputs(call: _Call, out: Any) -> list[torch.Tensor]:
    leaves, spec = pytree.tree_flatten(out)
    if call.out_spec is None:
        call.out_spec = spec
        call.out_leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _eager(key: int, tensors: list[torch.Tensor], state: list[torch.Tensor]) -> list[torch.Tensor]:
    call = _CALLS[key]
    return _outputs(call, _run(call, tensors, state))


@torch.library.register_fake("autopipe::opaque_function", lib=_LIB)
def _fake(key: int, tensors: list[torch.Tensor], state: list[torch.Tensor]) -> list[torch.Tensor]:
    call = _CALLS[key]
    with torch.no_grad():
        out = _outputs(call, _run(call, tensors, state))
    return [x.clone() for x in out]  # an op's outputs may not alias its inputs


# At the Autograd key: the Function's own apply records its backward (no derivative of ours)
_LIB.impl("opaque_function", _eager, "Autograd")


def _state_slots(modules: list[nn.Module]) -> tuple[list[tuple[dict[str, Any], str, int]], list[torch.Tensor]]:
    slots: list[tuple[dict[str, Any], str, int]] = []
    state: list[torch.Tensor] = []
    index: dict[int, int] = {}
    for sub in {id(s): s for m in modules for s in m.modules()}.values():
        for table in (sub._parameters, sub._buffers):
            for name, t in table.items():
                if t is not None:
                    slots.append((table, name, index.setdefault(id(t), len(state))))
                    if len(state) < len(index):
                        state.append(t)
    return slots, state


def _opaque_apply(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    slots, state = _state_slots([x for x in leaves if isinstance(x, nn.Module)])
    key = next(_KEYS)
    call = _Call(cls, spec, [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves], slots)
    _CALLS[key] = call
    out = OPAQUE_OP(key, tensors, state)
    given = iter(out)
    assert call.out_spec is not None  # the fake kernel ran
    return pytree.tree_unflatten([next(given) if x is _TENSOR else x for x in call.out_leaves], call.out_spec)


@contextlib.contextmanager
def opaque_functions() -> Iterator[tuple[dict[str, None], set[str]]]:
    """While tracing: each user-defined autograd.Function call becomes one opaque call (see the module
    docstring). Yields the names of the Functions kept opaque and of those that could not be (their
    fake run failed), which are traced as torch would: their forward's ops, no backward."""
    kept: dict[str, None] = {}
    lost: set[str] = set()
    original = torch.autograd.Function.apply.__func__  # type: ignore[attr-defined]

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        if cls.__module__.startswith("torch") or getattr(_inside, "depth", 0):
            return original(cls, *args, **kwargs)
        name = f"{cls.__module__}.{cls.__qualname__}"
        try:
            out = _opaque_apply(cls, args, kwargs)
        except Exception:  # e.g. a Function torch cannot run on fake tensors: the forward's ops, then
            kept.pop(name, None)
            lost.add(name)
            return original(cls, *args, **kwargs)
        kept.setdefault(name, None)
        return out

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield kept, lost
    finally:
        torch.autograd.Function.apply = classmethod(original)  # type: ignore[assignment,method-assign]
