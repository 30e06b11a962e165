"""The loss a job trains with: the model's own, or cross-entropy or MSE against the data's targets.

Losses: ``model`` takes the loss the model returns (``.loss``, ``["loss"]`` or a scalar first output);
``cross_entropy`` compares the model's logits (``.logits``, or its first output) with integer targets
(-100 ignored, as torch does); ``mse`` compares the first output with float targets; a factory may
return its own ``loss(outputs, target)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from ...errors import AutopipeError

__all__ = ['LOSSES', 'LossError', 'check_loss', 'cross_entropy', 'is_model_loss', 'loss_name', 'make_loss', 'model_loss', 'model_outputs_logits', 'mse', 'resolve_loss', 'scalar_outputs']


def model_loss(outputs: Any, pick: str | None = None) -> torch.Tensor:
    """The loss the model computed itself: ``.loss`` or ``["loss"]``, else the one scalar it returns
    anywhere in its tuple, dict or ModelOutput (nanoGPT's ``(logits, loss)``); ``pick`` names one
    by its place (``"1"``, ``"aux.loss"``) when there are several.

    Example:
        >>> logits, loss = torch.zeros(2, 3), torch.tensor(0.5)
        >>> model_loss((logits, loss)), model_loss({"out": logits, "total": loss})
        (tensor(0.5000), tensor(0.5000))
    """
    if pick is not None:
        found = dict(scalar_outputs(outputs, scalars_only=False)).get(pick)
        if not isinstance(found, torch.Tensor) or found.dim() != 0:
            raise AutopipeError(
                f"--loss model:{pick}: the model's outputs hold no scalar at {pick!r}; "
                f"its scalars: {', '.join(p for p, _ in scalar_outputs(outputs)) or 'none'}."
            )
        return found
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    candidates = scalar_outputs(outputs)
    if len(candidates) == 1:
        return candidates[0][1]
    if len(candidates) > 1:
        names = ", ".join(p for p, _ in candidates)
        raise AutopipeError(
            f"the model returns {len(candidates)} scalars ({names}); say which is the loss with "
            f"--loss model:{candidates[0][0]} (or model:<place> of another)."
        )
    raise AutopipeError(
        "the model's outputs hold no scalar loss; pass labels to the model (HF models compute "
        "the loss then) or give the trainer a loss_fn(outputs, target)."
    )


def scalar_outputs(outputs: Any, *, scalars_only: bool = True) -> list[tuple[str, torch.Tensor]]:
    """Every floating 0-dim tensor in a model's outputs with its place: ``"1"`` for a tuple's
    second item, ``"aux.loss"`` for a nested key (``scalars_only=False``: every tensor)."""
    found: list[tuple[str, torch.Tensor]] = []

    def walk(value: Any, place: str) -> None:
        if isinstance(value, torch.Tensor):
            if not scalars_only or (value.dim() == 0 and value.is_floating_point()):
                found.append((place, value))
        elif isinstance(value, dict):  # ModelOutput is an OrderedDict of the fields that are set
            for key, item in value.items():
                walk(item, f"{place}.{key}" if place else str(key))
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                walk(item, f"{place}.{i}" if place else str(i))

    walk(outputs, "")
    return found


LOSSES = ("auto", "model", "cross_entropy", "mse")


class LossError(AutopipeError):
    """The job cannot produce a scalar loss as configured."""


def model_outputs_logits(outputs: Any) -> torch.Tensor:
    """The prediction in a model's outputs: ``.logits``, ``["logits"]``, the first output, or the tensor."""
    for get in (lambda o: getattr(o, "logits", None), lambda o: o.get("logits") if isinstance(o, dict) else None):
        found = get(outputs)
        if isinstance(found, torch.Tensor):
            return found
    if isinstance(outputs, torch.Tensor):
        return outputs
    leaves = [v for v in pytree.tree_leaves(outputs) if isinstance(v, torch.Tensor)]
    if not leaves:
        raise LossError("the model returns no tensor to compute a loss on.")
    return leaves[0]


def cross_entropy(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the model's logits (…, C) against integer targets (…); -100 is ignored."""
    logits = model_outputs_logits(outputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1).long(), ignore_index=-100)


def mse(outputs: Any, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error of the model's first output against a float target of its shape."""
    pred = model_outputs_logits(outputs)
    return F.mse_loss(pred.float(), target.reshape(pred.shape).float())


def resolve_loss(name: str, task: str, factory_loss: Any, loss: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The loss a job trains with, and the example kwargs to trace the model with for it.

    ``auto`` is the factory's loss if it gave one, else the model's own. A HuggingFace model trained
    with another loss than its own is traced without ``labels``, so that it returns its logits.
    """
    if not callable(loss) and loss not in LOSSES and not is_model_loss(loss):
        raise LossError(f"unknown --loss {loss!r}; use one of {', '.join(LOSSES)} (or model:<place> to pick one of the model's scalars).")
    if loss == "auto":
        loss = factory_loss if factory_loss is not None else "model"
    kwargs = dict(kwargs)
    if not is_model_loss(loss) and task != "custom":
        if task == "seq2seq":
            raise LossError(f"{name} is a seq2seq model: train it with its own loss (--loss model); its decoder inputs come from the labels.")
        kwargs.pop("labels", None)
    return loss, kwargs


def is_model_loss(loss: Any) -> bool:
    """Whether the job trains on a loss the model returns: ``model``, or ``model:<place>`` naming
    which of its scalars (``model:1`` for the second item of a tuple)."""
    return loss in (None, "model") or (isinstance(loss, str) and loss.startswith("model:") and len(loss) > 6)


def loss_name(loss: Any) -> str:
    """How a job's loss is shown: its --loss name, or the factory function's name."""
    return loss if isinstance(loss, str) else f"{getattr(loss, '__name__', type(loss).__name__)} (the factory's)"


def make_loss(name: str | Callable[..., torch.Tensor] | None) -> Callable[[Any, Any], torch.Tensor] | None:
    """The loss function for a ``--loss`` name (None for ``model``: the engine takes the model's own)."""
    if callable(name):
        return name
    if name in (None, "model"):
        return None
    if is_model_loss(name):

        place = str(name).split(":", 1)[1]

        def picked(outputs: Any, target: Any = None) -> torch.Tensor:
            return model_loss(outputs, pick=place)

        picked.__name__ = str(name)
        return picked
    if name == "cross_entropy":
        return cross_entropy
    if name == "mse":
        return mse
    raise LossError(f"unknown --loss {name!r}; use one of {', '.join(LOSSES)}.")


def check_loss(seq: Any, loss: Any, name: str) -> tuple[tuple[int, ...], torch.dtype]:
    """Refuse a job that cannot produce a scalar loss, before it trains (convert and every rank call it).

    Runs nothing: the flattened model's outputs are rebuilt from the last layer's recorded shapes on
    the meta device. Returns the per-row shape and dtype of the prediction a user loss compares with
    its target (the logits), which synthetic targets are drawn like.
    """

    sigs = seq.infos[-1].outputs
    metas = tuple(torch.empty(s.shape, dtype=getattr(torch, s.dtype), device="meta") for s in sigs)
    outputs = seq.unpack_outputs(metas[0] if len(metas) == 1 else metas)
    described = ", ".join(f"{s.dtype}{list(s.shape)}" for s in sigs)
    if is_model_loss(loss):

        pick = None if loss in (None, "model") else str(loss).split(":", 1)[1]
        if pick is None and not scalar_outputs(outputs) and not isinstance(getattr(outputs, "loss", None), torch.Tensor):
            raise LossError(
                f"{name} returns {described}, no scalar loss: train it with --loss cross_entropy (class targets, "
                "y in --data) or --loss mse, give the factory's dict a \"loss\", or return the "
                "loss from forward."
            )
        try:
            model_loss(outputs, pick=pick)
        except AutopipeError as e:
            raise LossError(f"{name}: {e}") from None
        return (), torch.float32
    pred = model_outputs_logits(outputs)
    if loss == "cross_entropy" and (not pred.is_floating_point() or pred.dim() < 2):
        raise LossError(f"--loss cross_entropy needs logits (rows, ..., classes) but {name} returns {described}.")
    return tuple(pred.shape[1:]), pred.dtype
