"""Eval mode for traced layers: dropout off and batch norm on its running statistics.

``module.eval()`` does nothing to a flattened layer: the trace ran the model in train mode, so each
layer's graph calls ``aten.dropout(x, 0.1, True)``, ``aten.scaled_dot_product_attention(...,
dropout_p=0.1)`` and ``aten.batch_norm(..., training=True, ...)`` with those constants written in.
Evaluation through the pipeline then drew dropout masks (a CNN's held-out accuracy read 88.7 % where
the same weights score 91.4 % in eval mode) and would have moved batch norm's running statistics.

``traced_eval_mode(modules)`` puts every ``torch.fx.GraphModule`` below ``modules`` in eval mode for
the duration of a ``with`` block: each call of an aten operator whose schema names a ``train`` or
``training`` flag gets ``False`` and each ``dropout_p`` gets ``0.0`` (only literal constants: a
flag computed in the graph is left as it is), the graph is recompiled, and on exit the constants
are put back and the modules returned to train mode. Operators are found by their schema, not by
name, so every dropout variant, attention with dropout and batch norm are covered alike. Python
code of the user's that branched on ``self.training`` at trace time is not reachable here: the
branch taken in train mode is what the graph holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from torch import fx, nn

__all__ = ["traced_eval_mode", "train_mode_constants"]

_OFF = {"train": False, "training": False, "dropout_p": 0.0}  # an argument's name -> its value in eval mode


def train_mode_constants(graph: fx.Graph) -> list[tuple[fx.Node, int | str, object]]:
    """The train-mode constants of ``graph``: (node, argument position or keyword, value now) for
    every literal ``train``/``training`` True and non-zero ``dropout_p`` of an aten operator call."""
    found: list[tuple[fx.Node, int | str, object]] = []
    for node in graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.name not in _OFF:
                continue
            where: int | str
            if i < len(node.args):
                where, value = i, node.args[i]
            elif arg.name in node.kwargs:
                where, value = arg.name, node.kwargs[arg.name]
            else:
                continue  # the default: dropout_p 0.0, or no train flag given
            if isinstance(value, (bool, int, float)) and value != _OFF[arg.name]:
                found.append((node, where, value))
    return found


def _set(node: fx.Node, where: int | str, value: object) -> None:
    if isinstance(where, int):
        args = list(node.args)
        args[where] = value
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, where: value}


@contextlib.contextmanager
def traced_eval_mode(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Eval mode for ``modules`` and the traced layers in them (module docstring); train mode after.

    >>> g = fx.Graph()
    >>> g.output(g.call_function(torch.ops.aten.dropout.default, (g.placeholder("x"), 0.5, True)))
    output
    >>> layer = fx.GraphModule(nn.Module(), g)
    >>> with traced_eval_mode([layer]):
    ...     bool(layer(torch.ones(1000)).eq(1).all()), layer.training
    (True, False)
    >>> bool(layer(torch.ones(1000)).eq(1).all()), layer.training  # dropout again
    (False, True)
    """
    modules = list(modules)
    changed: list[tuple[fx.GraphModule, list[tuple[fx.Node, int | str, object]]]] = []
    seen: set[int] = set()
    for top in modules:
        for m in top.modules():
            if isinstance(m, fx.GraphModule) and id(m) not in seen:
                seen.add(id(m))
                constants = train_mode_constants(m.graph)
                if constants:
                    changed.append((m, constants))
    try:
        for m, constants in changed:
            for node, where, value in constants:
                _set(node, where, _OFF[_argument_name(node, where)])
            m.recompile()
        for top in modules:
            top.eval()
        yield
    finally:
        for m, constants in changed:
            for node, where, value in constants:
                _set(node, where, value)
            m.recompile()
        for top in modules:
            top.train()


def _argument_name(node: fx.Node, where: int | str) -> str:
    return where if isinstance(where, str) else node.target._schema.arguments[where].name  # type: ignore[union-attr]

