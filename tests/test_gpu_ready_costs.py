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


# ---- defect 9: the profiler's clock times the profiled device, not the current one -------------


class _ClockCuda(types.SimpleNamespace):
    """A stand-in ``torch.cuda`` for the clock: records which device each call is about."""

    def __init__(self) -> None:
        super().__init__(calls=[])
        calls = self.calls

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                pass

            def record(self, stream: Any = None) -> None:
                calls.append(("record", 0 if stream is None else stream.index))  # None: the current device's

            def elapsed_time(self, other: Any) -> float:
                return 2.0  # milliseconds

        self.Event = Event

    def synchronize(self, device: Any = None) -> None:
        self.calls.append(("synchronize", 0 if device is None else torch.device(device).index))

    def current_stream(self, device: Any = None) -> Any:
        return types.SimpleNamespace(index=0 if device is None else torch.device(device).index)


def test_the_profiler_clock_records_and_waits_on_the_profiled_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``profile --device cuda:1`` times cuda:1: its events go on cuda:1's stream and the clock waits
    for cuda:1, not for the current device (cuda:0), which would time nothing of the layer's."""
    from autopipe.costs.measure import median_seconds

    cuda = _ClockCuda()
    monkeypatch.setattr(torch, "cuda", cuda)
    seconds = median_seconds(lambda: None, device=torch.device("cuda", 1), repeats=3)
    assert seconds == pytest.approx(0.002)
    assert cuda.calls and all(index == 1 for _, index in cuda.calls), cuda.calls


# ---- defect 10: device errors are not taken for "this layer cannot be split" -------------------


def _small() -> tuple[Any, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    return autopipe.flatten(model, (x,)), x


def _fail_split_with(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    import torch.distributed.pipelining._backward as backward

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(backward, "stage_backward_input", failing)


def test_out_of_memory_while_profiling_a_layer_reaches_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """An out-of-memory error in a layer's split backward is an error, one line naming the layer,
    not a profile that quietly falls back to guessed split times."""
    seq, x = _small()
    _fail_split_with(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    with pytest.raises(autopipe.AutopipeError, match=r"profiling layer .* ran out of device memory"):
        autopipe.profile(seq, (x,), repeats=1, warmup=0, progress=False)


def test_a_cuda_error_while_profiling_a_layer_reaches_the_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA error (sticky: the context is unusable after it) stops the profile at the layer."""
    seq, x = _small()
    _fail_split_with(monkeypatch, RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(autopipe.AutopipeError, match="failed with a device error.*illegal memory access"):
        autopipe.profile(seq, (x,), repeats=1, warmup=0, progress=False)


def test_a_layer_torch_cannot_split_still_keeps_the_guess(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the suppression was for stays: an operator error of the split (not the device's) leaves
    the layer's split unmeasured and the profile made."""
    seq, x = _small()
    _fail_split_with(monkeypatch, RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn"))
    prof = autopipe.profile(seq, (x,), repeats=1, warmup=0, progress=False)
    assert all(layer.backward_input_time == 0 for layer in prof.layers)
