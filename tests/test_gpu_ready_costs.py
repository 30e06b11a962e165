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
from torch.utils._python_dispatch import TorchDispatchMode

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


# ---- defect 6: a GPU rank's measured peak is what the process holds there, reserved included ---

GIB = 2**30


class _MemoryCuda(types.SimpleNamespace):
    """A stand-in ``torch.cuda`` whose caching allocator peaked at 1 GiB allocated and 1.5 GiB
    reserved; device-wide readings are refused (another process may share the GPU)."""

    def __init__(self) -> None:
        super().__init__(devices=[])

    def _on(self, device: Any) -> None:
        self.devices.append(torch.device(device).index)

    def max_memory_allocated(self, device: Any = None) -> int:
        self._on(device)
        return GIB

    def max_memory_reserved(self, device: Any = None) -> int:
        self._on(device)
        return 3 * GIB // 2

    def memory_reserved(self, device: Any = None) -> int:
        self._on(device)
        return 3 * GIB // 2

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._on(device)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        raise AssertionError("a device-wide reading: it counts every process on the GPU")


def test_a_gpu_rank_s_peak_is_reserved_plus_what_the_process_holds_outside_the_allocator(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On ``cuda:1`` the peak is torch's reserved bytes (tensors, cached-but-free blocks, cuBLAS
    workspaces) plus this process's context and NCCL buffers (its NVML figure less the reserved
    bytes), all read for cuda:1 and for this process only; allocated is kept beside it."""
    from autopipe.runtime.logs import peak as peak_module

    cuda = _MemoryCuda()
    monkeypatch.setattr(torch, "cuda", cuda)
    monkeypatch.setattr(peak_module, "process_device_bytes", lambda device: 23 * GIB // 10)  # NVML, this pid
    peak = peak_module.PeakMemory(torch.device("cuda", 1))
    peak.reset()
    assert peak.read() == 23 * GIB // 10  # 1.5 GiB reserved + 0.8 GiB context and NCCL
    assert (peak.detail.allocated, peak.detail.reserved) == (GIB, 3 * GIB // 2)
    assert peak.outside_known and set(cuda.devices) == {1}


def test_without_nvml_the_outside_part_is_unknown_not_guessed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where NVML cannot see the process, the peak is the allocator's reserved bytes and says the
    context is not in it (``outside_known``), rather than reading the whole device."""
    from autopipe.runtime.logs import peak as peak_module

    monkeypatch.setattr(torch, "cuda", _MemoryCuda())
    monkeypatch.setattr(peak_module, "process_device_bytes", lambda device: None)
    peak = peak_module.PeakMemory(torch.device("cuda", 0))
    peak.reset()
    assert peak.read() == 3 * GIB // 2 and not peak.outside_known


# ---- defect 7: the optimizer step is in the measured and the modelled peak ----------------------


def _touch(size: int) -> Any:
    import mmap

    # fresh anonymous pages, not a tensor: a heap kept by keep_freed_memory could serve it unseen
    held = mmap.mmap(-1, size)
    torch.frombuffer(held, dtype=torch.uint8).fill_(1)
    return held


def test_the_measured_peak_includes_the_optimizer_step_after_the_statistics_read() -> None:
    """The trainer reads the peak before it steps the optimizer (the update depends on that read):
    what the optimizer step allocates afterwards is reported with the next step, and a read after
    the step (the reserve probe, the doctor) sees it at once."""
    from autopipe.runtime.logs.peak import PeakMemory

    peak = PeakMemory(torch.device("cpu"))
    size = 64 * 2**20
    peak.reset()  # step 1
    peak.read()  # the statistics read: nothing large yet
    held = _touch(size)  # the optimizer step's temporaries
    assert peak.read() >= 0.9 * size  # a read after the step sees them
    held.close()
    peak.reset()  # step 2: its read reports step 1's optimizer step too
    assert peak.read() >= 0.9 * size


@pytest.mark.parametrize("device", ["cpu", "mps"])
def test_the_modelled_optimizer_step_is_what_the_runtimes_adamw_allocates(device: str) -> None:
    """The memory model's step temporaries are what the runtime's AdamW for that device type
    allocates during ``step()`` beyond its state: none for the fused kernel it runs on a CPU (and a
    GPU), one state-sized tensor per parameter for foreach AdamW elsewhere (an "mps" profile; the
    tensors stay on the CPU, where foreach allocates as it would there)."""
    from dataclasses import replace

    from autopipe.costs.layer_costs import DeviceInfo, Profile
    from autopipe.costs.measure import LiveBytes
    from autopipe.planner.memory import layer_memory
    from autopipe.runtime.training.optim import TrainConfig, optimizer_class, optimizer_options, param_groups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 256))
    params = dict(model.named_parameters())
    config = TrainConfig()
    optimizer = optimizer_class(config)(param_groups(params, config), **optimizer_options(config, device))
    assert optimizer.defaults.get("fused") is (True if device == "cpu" else None)
    for p in params.values():
        p.grad = torch.randn_like(p)
    optimizer.step()  # creates the state
    live = LiveBytes()
    with live:
        optimizer.step()
    layer_bytes = [sum(p.numel() * 4 for p in layer.parameters()) for layer in model]
    profile = replace(Profile.from_costs([1.0, 1.0], param_bytes=layer_bytes), device=DeviceInfo(type=device))
    modelled = sum(layer_memory(profile).step)
    assert modelled == (0 if device == "cpu" else sum(layer_bytes))
    assert abs(live.peak - modelled) <= 0.01 * sum(layer_bytes), (live.peak, modelled)


# ---- defect 5: the reserve is the probe's own, and a polluted figure is not kept for good --------


def test_a_polluted_reserve_measurement_serves_the_run_but_is_not_cached(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Any) -> None:
    """A probe whose figure is not clean (on a GPU: NVML could not see its processes, or the asking
    process held GPU memory while it ran) is used for this run and measured again next time, not
    cached for good; a clean one is cached."""
    from autopipe.runtime.checks.reserve import runtime_reserve

    monkeypatch.setenv("AUTOPIPE_CACHE", str(tmp_path))
    runs: list[int] = []

    def probe(device: str, **kwargs: Any) -> dict[str, int]:
        runs.append(1)
        return {"reserve_bytes": 5 << 20, "clean": int(len(runs) > 2)}

    monkeypatch.setattr("autopipe.runtime.checks.reserve.measure_reserve", probe)
    assert [runtime_reserve("cpu") for _ in range(4)] == [5 << 20] * 4
    assert len(runs) == 3  # two polluted measurements, then a clean one, cached


def test_a_probe_beside_the_user_s_model_on_the_gpu_is_known_to_be(monkeypatch: pytest.MonkeyPatch) -> None:
    """The asking process holding GPU memory (convert moved the model there) marks the probe's
    figure as taken beside it."""
    from autopipe.runtime.checks.reserve import holds_gpu_memory

    state = {"init": False, "reserved": 0}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: state["init"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    assert not holds_gpu_memory()
    state.update(init=True, reserved=GIB)
    assert holds_gpu_memory()


# ---- defect 15: initial weights are the same on every device type -------------------------------


class RandomDraws(TorchDispatchMode):
    """Notes into ``drawn`` the device type of every tensor a random init (normal_, uniform_) writes."""

    def __init__(self, drawn: list[str]) -> None:
        super().__init__()
        self.drawn = drawn

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func._overloadpacket in (torch.ops.aten.normal_, torch.ops.aten.uniform_):
            self.drawn.append(args[0].device.type)
        return func(*args, **(kwargs or {}))


def test_weights_on_a_gpu_are_initialised_from_the_cpu_generator() -> None:
    """A GPU's init draws from the GPU's generator, whose numbers for a seed differ from the CPU's:
    the same job started from other weights on a GPU than on a CPU. ``host_init`` has the model
    hold CPU twins of its ``cuda`` tensors while they are initialised (fake tensors here: the random
    ops are recorded by device), then the tensors again, the same objects. (Fake CUDA tensors cannot
    take the twins' values back on a CPU-only torch, so the test leaves by an exception, which skips
    that copy.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopipe.runtime.stage.weights import host_init, materialize_

    drawn: list[str] = []

    class Leave(Exception):
        pass

    layer = nn.Linear(8, 8, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize_(layer, ["weight", "bias"], device="cuda")  # as a rank builds its stage on its GPU
        weight = layer.weight
        with pytest.raises(Leave), RandomDraws(drawn), host_init(layer, [layer.weight, layer.bias]):
            assert layer.weight.device.type == "cpu"
            layer.reset_parameters()
            raise Leave
    assert drawn and set(drawn) == {"cpu"}, drawn
    assert layer.weight is weight and {p.device.type for p in layer.parameters()} == {"cuda"}


def test_init_weights_initialises_the_cpu_twins_of_a_gpu_rank_s_tensors() -> None:
    """``init_weights_`` on a rank's GPU tensors initialises every module holding one (through its
    CPU twin), with random numbers drawn on the CPU. (Its last step, copying the values onto the
    fake CUDA tensors, cannot run on a CPU-only torch: everything before it can, and is checked.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autopipe.runtime.stage.weights import init_weights_, materialize_

    drawn: list[str] = []

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to("meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        tensors = materialize_(model, ["0.weight", "0.bias", "1.weight", "1.bias"], device="cuda")
        with RandomDraws(drawn), pytest.raises(RuntimeError, match="cuda"):
            init_weights_(model, tensors, seed=0)
    assert len(drawn) == 4 and set(drawn) == {"cpu"}, drawn  # both Linears' weights and biases
    assert [p.device.type for p in model.parameters()] == ["cuda"] * 4
