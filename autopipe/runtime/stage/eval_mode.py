"""Eval mode for traced layers: dropout off and batch norm on its running statistics.

``module.eval()`` does nothing to a flattened layer: the trace ran the model in train mode, so each
layer's graph calls ``aten.dropout(x, 0.1, True)``, ``aten.scaled_dot_product_attention(...,
dropout_p=0.1)`` and ``aten.batch_norm(..., training=True, ...)`` with those constants written in.
Evaluation through the pipeline then drew dropout masks (a CNN's held-out accuracy read 88.7 % where
the same weights score 91.4 % in eval mode) and would have moved batch norm's running statistics.

``traced_eval_mode(modules)`` puts ``modules`` in eval mode for the duration of a ``with`` block and
runs it under a ``TorchFunctionMode`` that gives every call of an operator whose schema names a
``train`` or ``training`` flag ``False``, and every ``dropout_p`` ``0.0`` (literal values only), then
back to train mode. Operators are found by their schema, not by name, so every dropout variant,
attention with dropout and batch norm are covered alike; the graphs themselves are not touched
(recompiling a graph wrapped by FSDP2, whose class is a subclass made at wrap time, recursed
without end). Python code of the user's that branched on ``self.training`` at trace time is not
reachable here: the branch taken in train mode is what the graph holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["traced_eval_mode"]

_OFF = {"train": False, "training": False, "dropout_p": 0.0}  # an argument's name -> its value in eval mode


def _eval_arguments(func: object, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of an operator call with its train-mode constants set off."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for i, arg in enumerate(schema.arguments):
        off = _OFF.get(arg.name)
        if off is None:
            continue
        if i < len(args) and isinstance(args[i], (bool, int, float)):
            args[i] = off
        elif isinstance(kwargs.get(arg.name), (bool, int, float)):
            kwargs[arg.name] = off
    return tuple(args), kwargs


class _EvalMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        args, kwargs = _eval_arguments(func, tuple(args), dict(kwargs or {}))
        return func(*args, **kwargs)


@contextlib.contextmanager
def traced_eval_mode(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Eval mode for ``modules`` and the traced layers in them (module docstring); train mode after.

    >>> import torch
    >>> from torch import fx
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
    try:
        for m in modules:
            m.eval()
        with _EvalMode():
            yield
    finally:
        for m in modules:
            m.train()
