"""The random state a model's computation draws from: the CPU generator's and each device's own.

Dropout on a GPU draws from that GPU's generator, not from the CPU's, so a check that runs a model
twice on the same random numbers must put back the generator of every device the model computes
on. ``torch.get_rng_state`` / ``torch.set_rng_state`` reach the CPU generator only.

Example:
    >>> import torch
    >>> x = torch.ones(1000)
    >>> state = RngState.capture([x])
    >>> a = torch.nn.functional.dropout(x, 0.5)
    >>> state.restore()
    >>> torch.equal(a, torch.nn.functional.dropout(x, 0.5))
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

__all__ = ["RngState", "compute_devices", "draws_random"]

# Arguments that make a seeded operator draw nothing when they are a literal 0 (dropout's p,
# attention's dropout_p): a model built with dropout 0 still calls dropout, which draws nothing.
_PROBABILITY_ARGUMENTS = ("p", "dropout_p")


def draws_random(layer: torch.nn.Module) -> bool:
    """Whether running ``layer`` may draw from a random generator: True unless every graph in it is
    a traced graph (``torch.fx``) whose operators torch does not tag as seeded
    (``Tag.nondeterministic_seeded``: dropout, bernoulli, rand, ...) or whose probability
    argument is a literal 0. A module that is not a traced graph, or an operator that is not one of
    torch's, counts as drawing (the answer may be True for a layer that draws nothing, never the
    reverse). The runtimes seed a layer per micro-batch only when it draws: the seed costs 60 µs a
    call (``torch.manual_seed`` seeds every device), 10 ms a step on a 20-layer rank.

    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
    >>> draws_random(gm), draws_random(torch.nn.Linear(2, 2))
    (True, True)
    """
    import operator

    from torch import fx

    from .batch_free import BatchFreeValue

    if not isinstance(layer, fx.GraphModule):
        return True
    graphs = [m for m in layer.modules() if isinstance(m, fx.GraphModule)]
    plain = {operator.getitem, getattr}
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op in ("call_module", "call_method"):
                if node.op == "call_module" and node.target == "_guards_fn":
                    continue  # torch.export's check of the inputs' shapes: draws nothing
                if node.op == "call_module" and isinstance(gm.get_submodule(node.target), (fx.GraphModule, BatchFreeValue)):
                    continue  # a graph is judged on its own; a batch-free value is made by pure operators only
                return True
            if node.op != "call_function":
                continue
            target = node.target
            if isinstance(target, torch._ops.OpOverload):
                if torch.Tag.nondeterministic_seeded in target.tags and not _zero_probability(node, target):
                    return True
            elif isinstance(target, torch._ops.HigherOrderOperator) or target in plain:
                continue  # its subgraphs are GraphModules in layer.modules(), judged above
            elif getattr(target, "__module__", "").startswith(("autopipe.", "_operator")):
                continue  # autopipe's own tuple helpers
            else:
                return True
    return False


def _zero_probability(node: "torch.fx.Node", op: "torch._ops.OpOverload") -> bool:
    """Whether the seeded operator ``op`` at ``node`` is given a literal probability of 0."""
    for i, arg in enumerate(op._schema.arguments):
        if arg.name in _PROBABILITY_ARGUMENTS:
            value = node.kwargs[arg.name] if arg.name in node.kwargs else node.args[i] if i < len(node.args) else arg.default_value
            return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0
    return False


def compute_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The devices ``tensors`` live on that own a generator: the CPU always, then each accelerator
    (``cuda:1``, ...) once, with its index made explicit; meta tensors draw nothing."""
    out = [torch.device("cpu")]
    for t in tensors:
        device = t.device
        if device.type in ("cpu", "meta"):
            continue
        if device.index is None:
            device = torch.device(device.type, torch.get_device_module(device.type).current_device())
        if device not in out:
            out.append(device)
    return out


@dataclass
class RngState:
    """The states of the generators of some devices, taken together and put back together."""

    states: list[tuple[torch.device, torch.Tensor]]

    @classmethod
    def capture(cls, tensors: Iterable[torch.Tensor]) -> "RngState":
        """The state of every generator ``tensors``' computation can draw from (``compute_devices``)."""
        return cls([(d, _get(d)) for d in compute_devices(tensors)])

    def restore(self) -> None:
        """Put every captured generator back as it was."""
        for device, state in self.states:
            _set(device, state)


def _get(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.default_generator.get_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def _set(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        # the generator itself, not torch.set_rng_state: the same path for every device
        torch.default_generator.set_state(state)
        return
    torch.get_device_module(device.type).set_rng_state(state, device)
