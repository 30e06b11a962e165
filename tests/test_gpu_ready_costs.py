"""GPU code paths of the trace check, the profiler and the memory probes, tested on a CPU (issue 22).

Each test stands in for what a GPU would do differently: a generator that ``torch.set_rng_state``
does not reach, a stand-in ``torch.cuda`` module that records which device is synchronised and
which memory counters are read, an out-of-memory error raised inside a layer.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch import nn

import autopipe
from autopipe.graph.rng import RngState, compute_devices


class _StandInCuda(types.SimpleNamespace):
    """What the code under test calls on ``torch.cuda``, recorded: per-device RNG states,
    synchronisation, events, memory counters."""

    def __init__(self, devices: int = 2) -> None:
        super().__init__(calls=[], rng={i: torch.tensor([i], dtype=torch.uint8) for i in range(devices)})

    def current_device(self) -> int:
        return 0

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        index = torch.device(device).index or 0
        self.calls.append(("get_rng_state", index))
        return self.rng[index].clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        index = torch.device(device).index or 0
        self.calls.append(("set_rng_state", index))
        self.rng[index] = state.clone()


# ---- defect 1: the trace check puts back every generator the model draws from ------------------


def test_the_trace_check_puts_back_the_generator_dropout_draws_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """flatten compares the traced layers with the eager model on the same random numbers. A model in
    train mode with dropout draws them from its device's generator; ``torch.set_rng_state`` restores
    the CPU's only, which on a GPU leaves the CUDA generator advanced and the check failing. With the
    CPU-only call made a no-op (as it is for a GPU's generator) the check must still pass."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4)).train()
    x = torch.randn(8, 16)
    monkeypatch.setattr(torch, "set_rng_state", lambda state: None)
    seq = autopipe.flatten(model, (x,))  # raised TraceMismatchError before the fix
    assert len(seq.layers) == 3


def test_the_generators_of_the_model_s_devices_are_captured_and_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model on ``cuda:1``: the CUDA generator of device 1 (not the current device 0) is read and
    written back, besides the CPU's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        weight = torch.empty(4, 4, device="cuda:1")
    cuda = _StandInCuda()
    monkeypatch.setattr(torch, "get_device_module", lambda kind: cuda if kind == "cuda" else None)
    assert compute_devices([weight]) == [torch.device("cpu"), torch.device("cuda", 1)]
    state = RngState.capture([weight])
    cuda.rng[1] = torch.tensor([99], dtype=torch.uint8)  # the model drew random numbers on cuda:1
    state.restore()
    assert int(cuda.rng[1]) == 1
    assert ("set_rng_state", 1) in cuda.calls and ("set_rng_state", 0) not in cuda.calls
