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

__all__ = ["RngState", "compute_devices"]


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
