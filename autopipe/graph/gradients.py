"""No silent loss of a backward: every parameter the eager model trains gets a gradient through the graph.

A forward-only trace can leave parameters that the graph uses but that no output's gradient reaches:
a custom autograd.Function whose forward runs under ``torch.no_grad()`` because its hand-written
backward recomputes it (Reformer's reversible layers), when torch cannot keep the Function opaque
(autopipe/graph/opaque.py). The job would train nothing there, and the outputs (what flatten's
validation compares) are right. The check walks the graph once (linear in its nodes, no tensor
work); only when it finds such parameters does it ask the eager model, with one backward on the
example batch (on meta for a meta model: shapes only), whether they should have had a gradient, and
the graph, with one backward of its own, whether it gives them one after all (an in-place write into a
tensor carries a gradient along no data edge the walk follows).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ..errors import TraceMismatchError
from .rng import RngState

__all__ = ["check_gradients", "unreached_parameters"]

# ops whose output carries no gradient from their inputs
_NO_GRAD_OPS = {torch.ops.aten.detach.default, torch.ops.aten.detach_.default}


def _carries(node: fx.Node) -> bool:
    """Whether ``node``'s value can carry a gradient at all (a float tensor, or a tuple of them)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.is_floating_point() or val.is_complex()
    return isinstance(val, (list, tuple)) or val is None


def unreached_parameters(ep: torch.export.ExportedProgram) -> list[str]:
    """Names of the parameters (requiring grad) the graph reads but no floating output's gradient reaches.

    Example:
        >>> class M(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             x = self.a(x)
        ...         return self.b(x)
        >>> unreached_parameters(torch.export.export(M(), (torch.randn(1, 2),), strict=False))
        ['a.bias', 'a.weight']
    """
    gm = ep.graph_module
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    trainable = {name for name in ep.graph_signature.parameters if ep.state_dict[name].requires_grad}
    params = {by_name[s.arg.name]: s.target for s in ep.graph_signature.input_specs
              if s.kind == InputKind.PARAMETER and s.target in trainable}
    grad_on = True
    carrying: set[fx.Node] = set(params)
    cut: set[fx.Node] = set()  # nodes whose inputs' gradients stop there
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is torch._C._set_grad_enabled:
            grad_on = bool(n.args[0])
            continue
        blocked = (not grad_on or n.target in _NO_GRAD_OPS or not _carries(n)
                   or (n.target is torch.ops.higher_order.wrap_with_set_grad_enabled and not n.args[0]))
        if blocked:
            cut.add(n)
        elif any(a in carrying for a in n.all_input_nodes):
            carrying.add(n)
    # back from the outputs along edges a gradient flows on
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    specs = ep.graph_signature.output_specs
    todo = [v for s, v in zip(specs, outputs) if s.kind == OutputKind.USER_OUTPUT and isinstance(v, fx.Node)
            and v in carrying]
    reached: set[fx.Node] = set()
    while todo:
        n = todo.pop()
        if n in reached:
            continue
        reached.add(n)
        if n not in cut:
            todo.extend(a for a in n.all_input_nodes if a in carrying)
    return sorted(name for node, name in params.items() if node.users and node not in reached)


def check_gradients(model: nn.Module, ep: torch.export.ExportedProgram, args: tuple[Any, ...],
                    kwargs: dict[str, Any], lost: set[str] | None = None) -> None:
    """Raise TraceMismatchError when a parameter the eager model gives a gradient gets none through ``ep``.

    ``lost``: the custom autograd.Functions torch traced forward-only (named in the error).
    """
    unreached = unreached_parameters(ep)
    if not unreached:
        return
    trained = _eager_trained(model, args, kwargs, unreached)
    suspect = [n for n in unreached if n in trained]
    if not suspect:
        return
    # the walk follows data edges, and an in-place write (RWKV's ``out[:, t] = ...``) feeds its target
    # without one: the graph's own backward on the example batch is the word on what it trains
    through_graph = _eager_trained(ep.module(), args, kwargs, suspect)
    missing = [n for n in suspect if n not in through_graph]
    if not missing:
        return
    shown = ", ".join(missing[:3]) + (f" +{len(missing) - 3}" if len(missing) > 3 else "")
    if lost:
        cause = (f"they are computed inside custom autograd.Function {', '.join(sorted(lost))}, whose hand-written "
                 "backward the trace could not keep (autopipe keeps such a Function as one opaque call where torch "
                 "can run it on fake tensors). Rewrite that Function's forward with plain torch ops, or report the model.")
    else:
        cause = "the trace differentiates another path than eager Python does. Report the model."
    raise TraceMismatchError(f"the flattened {type(model).__name__} gives no gradient to {len(missing)} parameters "
                             f"the eager model trains ({shown}): {cause}")


def _eager_trained(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], names: list[str]) -> set[str]:
    """Of ``names``, the parameters one backward of the eager model (every float output) reaches."""
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta:
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
    params = [model.get_parameter(n) for n in names]
    saved = {} if on_meta else {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()
                                if isinstance(v, torch.Tensor)}
    rng = None if on_meta else RngState.capture([*saved.values(), *params])
    try:
        with torch.enable_grad():
            out = model(*args, **kwargs)
            leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.requires_grad]
            if not leaves:
                return set()
            grads = torch.autograd.grad(leaves, params, [torch.ones_like(x) for x in leaves], allow_unused=True)
    except Exception:  # on meta, an op without a meta kernel: take the graph's word
        if not on_meta:
            raise
        return set(names)
    finally:
        with torch.no_grad():
            for k, v in model.state_dict(keep_vars=True).items():
                if k in saved:
                    v.copy_(saved[k])
        if rng is not None:
            rng.restore()
    return {n for n, g in zip(names, grads) if g is not None}

