"""Measuring one layer: time, saved activations, transient memory; and leaving the model as it was.

Mechanism only: :mod:`autopipe.profile` decides which layers to measure and assembles the record.
A layer's value is what the DeepSpeed layer format allows: a Tensor or a tuple of Tensors.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Union

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..graph.batch_free import held_tensors, making_value
from ..graph.recompute import run_layer
from ..graph.sequence import as_tuple

__all__ = [
    "Value",
    "Timing",
    "as_tuple",
    "storage_key",
    "static_storage_keys",
    "backward_targets",
    "time_layer",
    "recompute_extras",
    "fresh_casts",
    "run_fresh",
    "time_split",
    "grad_outputs",
    "grads_put_back",
    "median_iqr",
    "weight_hold_change",
    "LiveBytes",
    "peak_bytes",
    "saved_pass",
    "StateGuard",
    "tensor_bytes",
    "is_device_error",
]

Value = Union[Tensor, tuple[Tensor, ...]]


def storage_key(t: Tensor) -> int:
    """Identity of a tensor's storage. ``_cdata`` (the StorageImpl address) rather than data_ptr,
    because every meta storage has data_ptr 0; views and detached copies share the key."""
    return t.untyped_storage()._cdata


def tensor_bytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def static_storage_keys(layer: nn.Module) -> set[int]:
    """Storages that live for the whole step: parameters, buffers and tensor constants of a layer.

    They are not activations even when autograd saves them (a Linear saves its weight)."""
    keys = {storage_key(t) for t in layer.parameters()}
    keys |= {storage_key(t) for t in layer.buffers()}
    for m in layer.modules():
        # fx GraphModules keep some constants as plain tensor attributes.
        keys |= {storage_key(v) for v in vars(m).values() if isinstance(v, Tensor)}
    # batch-free values (masks, rotary tables) a stage makes once and every micro-batch reads
    keys |= {storage_key(t) for t in held_tensors(layer)}
    return keys


def fresh_casts() -> None:
    """Forget the weight casts autocast keeps while its context is open, as a new micro-batch does.

    A job enters autocast afresh for each micro-batch's forward (``runtime/stage/build.py``), so each
    casts its weights again; the profiler keeps one autocast context open over a layer's repeats,
    whose cache would leave every cast but the first out of the time. Measured on a bf16 GPT-2
    (6 x 256, vocab 4096, CPU): the job's forwards took 1.22x and 1.40x the profiled ones per rank
    with the cache kept. A no-op outside autocast."""
    torch.clear_autocast_cache()


def run_fresh(layer: nn.Module, x: Value, mode: str = "none", **kwargs: Any) -> Value:
    """``run_layer`` as one micro-batch of a job runs it (``fresh_casts`` first)."""
    fresh_casts()
    return run_layer(layer, x, mode, **kwargs)


def backward_targets(layer: nn.Module, x: Value) -> list[Tensor]:
    """What a pipeline stage's backward computes gradients for: trainable parameters and inputs
    that require grad. ``.grad`` is left as it was (taken with torch.autograd.grad, or put back)."""
    targets = [p for p in layer.parameters() if p.requires_grad]
    targets += [t for t in as_tuple(x) if isinstance(t, Tensor) and t.requires_grad]
    return targets


def grad_outputs(out: Value) -> tuple[list[Tensor], list[Tensor]]:
    outs = [o for o in as_tuple(out) if isinstance(o, Tensor) and o.requires_grad]
    return outs, [torch.ones_like(o) for o in outs]


def _unviewed(outs: list[Tensor]) -> list[Tensor]:
    """The outputs as a pipeline stage can detach them in place, which torch refuses for views (the
    runtime's chunks return them unviewed under zero-bubble schedules for the same reason)."""
    return [o.clone() if o._base is not None else o for o in outs]


@contextlib.contextmanager
def grads_put_back(tensors: list[Tensor]) -> Iterator[None]:
    """``.grad`` of ``tensors`` as it was before, whatever the block sets or raises."""
    before = [t.grad for t in tensors]
    try:
        yield
    finally:
        for t, g in zip(tensors, before):
            t.grad = g


class _Clock:
    """Elapsed seconds of a region: CUDA events on a GPU (kernels are asynchronous), else wall clock.

    The events are recorded on, and the wait is for, the profiled device's stream: ``--device
    cuda:1`` times cuda:1's kernels, whichever device is current (cuda:0 unless set)."""

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record(stream)
            result = fn()
            end.record(stream)
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1000.0, result
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result


@dataclass(frozen=True)
class Timing:
    forward: float
    backward: float
    forward_spread: float
    backward_spread: float
    samples: int = 0  # timed runs taken (more than asked for when the spread stayed wide)


def median_iqr(samples: list[float]) -> tuple[float, float]:
    """(median, interquartile range) of ``samples``; (the one sample, 0) for fewer than two."""
    return _median_iqr(samples)


def is_device_error(error: BaseException) -> bool:
    """Whether ``error`` is the device failing (out of memory, a CUDA or NCCL error, a device-side
    assert) rather than an operator torch refuses: the former must reach the user, never be taken
    for "this layer cannot be split" (a sticky CUDA error would surface later somewhere else)."""
    if isinstance(error, (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", torch.OutOfMemoryError))):
        return True
    text = str(error)
    return any(mark in text for mark in _DEVICE_ERRORS)


_DEVICE_ERRORS = ("out of memory", "CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "NCCL error",
                  "device-side assert", "HIP error")


@contextlib.contextmanager
def _unless_unsplittable() -> Iterator[None]:
    """Swallow the RuntimeError of a layer torch cannot split into input and weight passes; let
    device errors (``is_device_error``) through."""
    try:
        yield
    except RuntimeError as error:
        if is_device_error(error):
            raise


def _median_iqr(samples: list[float]) -> tuple[float, float]:
    if len(samples) < 2:
        return (samples[0] if samples else 0.0), 0.0
    q = statistics.quantiles(samples, n=4, method="inclusive")
    return statistics.median(samples), q[2] - q[0]


def median_seconds(fn: Callable[[], Any], *, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after one untimed run."""
    clock = _Clock(device)
    fn()
    return statistics.median(clock(fn)[0] for _ in range(repeats))


# Adaptive timing: after the asked-for repeats, keep going (up to this many times as many) while the
# interquartile range is above this share of the median: a busy machine gets more samples, not a
# worse median.
MAX_REPEAT_FACTOR = 4
TARGET_SPREAD = 0.10


def _settled(samples: list[float], target: float) -> bool:
    median, spread = _median_iqr(samples)
    return median <= 0 or spread <= target * median


def time_layer(
    layer: nn.Module, x: Value, *, device: torch.device, warmup: int, repeats: int, mode: str = "none",
    target_spread: float | None = TARGET_SPREAD,
) -> Timing:
    """Median forward and backward seconds of ``layer`` on ``x`` after ``warmup`` untimed runs.

    Each repeat is a fresh forward then a backward over it, as a pipeline stage runs a micro-batch.
    Under a recompute ``mode`` the backward includes the recomputation. With ``target_spread``, runs
    beyond ``repeats`` (up to ``MAX_REPEAT_FACTOR`` × repeats) until the interquartile range of both
    the forward and the backward samples is at most that share of their median.
    """
    run = _Runner(layer, x, device)
    fwd: list[float] = []
    bwd: list[float] = []
    limit = warmup + repeats * (MAX_REPEAT_FACTOR if target_spread else 1)
    for i in range(limit):
        if i >= warmup + repeats and _settled(fwd, target_spread) and _settled(bwd, target_spread):  # type: ignore[arg-type]
            break
        tf, tb = run(mode)
        if i >= warmup:
            fwd.append(tf)
            bwd.append(tb)
    (f, fs), (b, bs) = _median_iqr(fwd), _median_iqr(bwd)
    return Timing(forward=f, backward=b, forward_spread=fs, backward_spread=bs, samples=len(fwd))


def recompute_extras(layer: nn.Module, x: Value, modes: Iterable[str], *, device: torch.device, warmup: int,
                     repeats: int) -> dict[str, float]:
    """Per recompute mode, the seconds it adds to ``layer``'s backward: the median over ``repeats``
    rounds of (backward under the mode - plain backward), both timed in the same round.

    Why paired: a difference of two medians timed a second apart carries both runs' drift. A GPT-2
    block (CPU) read 7.9 to 11.0 ms of full-recompute extra over four profiles that way, with its
    forward steady at 9.0-9.4 ms; paired in rounds, the drift of the machine cancels out. Noise can
    make the extra of a cheap layer negative: it is nothing then."""
    modes = list(modes)
    run = _Runner(layer, x, device)
    diffs: dict[str, list[float]] = {m: [] for m in modes}
    for i in range(warmup + repeats):
        _, plain = run("none")
        for m in modes:
            _, tb = run(m)
            if i >= warmup:
                diffs[m].append(tb - plain)
    return {m: max(0.0, statistics.median(d)) if d else 0.0 for m, d in diffs.items()}


class _Runner:
    """One micro-batch of a layer, timed: a fresh forward, then the backward over it to its
    parameters and inputs with gradients given ready-made (a pipeline receives them)."""

    def __init__(self, layer: nn.Module, x: Value, device: torch.device) -> None:
        self.layer, self.x = layer, x
        self.clock = _Clock(device)
        self.targets = backward_targets(layer, x)
        self.grads: list[Tensor] | None = None

    def __call__(self, mode: str) -> tuple[float, float]:
        tf, out = self.clock(lambda: run_fresh(self.layer, self.x, mode))
        outs, fresh = grad_outputs(out)
        # allocated once, outside the timing
        self.grads = self.grads if self.grads is not None and len(self.grads) == len(fresh) else fresh
        tb = 0.0
        if outs and self.targets:
            grads = self.grads
            fresh_casts()  # the job's backward runs after the forward's autocast has closed: a recomputation casts again
            tb, _ = self.clock(lambda: torch.autograd.grad(outs, self.targets, grads, allow_unused=True))
        return tf, tb


def time_split(layer: nn.Module, x: Value, *, device: torch.device, warmup: int, repeats: int,
               mode: str = "none") -> tuple[float, float] | None:
    """Median seconds of the two passes a zero-bubble schedule splits a backward into: input
    gradients (B), then weight gradients (W), each run by torch.distributed.pipelining's own
    ``stage_backward_input`` / ``stage_backward_weight`` as its PipelineStage runs them. None when
    there is no split to time: no parameter, or no input that wants a gradient (the first stage's W
    is then a whole backward), or a torch without them. ``.grad`` is put back as it was.

    Why measure it: the split is not the whole backward cut in two. On a GPT-2 block (CPU) W took
    0.31 of B + W, and B + W took 1.10-1.16x the whole backward (each pass walks its part of the graph).
    """
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:
        return None
    params = [p for p in layer.parameters() if p.requires_grad]
    inputs = [t for t in as_tuple(x) if isinstance(t, Tensor) and t.requires_grad]
    if not params or not inputs:
        return None
    clock = _Clock(device)
    b_times: list[float] = []
    w_times: list[float] = []
    grads: list[Tensor] | None = None
    with grads_put_back(params + inputs), _unless_unsplittable():
        for p in params:
            p.grad = None  # W adds into an existing .grad in place: keep the caller's out of reach
        for i in range(warmup + repeats):
            out = run_fresh(layer, x, mode)
            outs, fresh = grad_outputs(out)
            if not outs:
                return None
            outs = _unviewed(outs)
            grads = grads if grads is not None and len(grads) == len(fresh) else fresh
            fresh_casts()
            tb, (_, groups) = clock(lambda: stage_backward_input(outs, grads, inputs, iter(params)))
            for o in outs:
                o.detach_()  # as the stage does: only what W needs stays alive
            tw, _ = clock(lambda: stage_backward_weight(iter(params), groups))
            out = outs = groups = None  # free this run's graph before the next forward
            if i >= warmup:
                b_times.append(tb)
                w_times.append(tw)
        return statistics.median(b_times), statistics.median(w_times)
    return None  # a layer torch cannot split this way (RuntimeError): zbv plans keep the 0.5 guess for it


def weight_hold_change(layer: nn.Module, x: Value, *, mode: str = "none") -> int | None:
    """Bytes a micro-batch of ``layer`` holds after a zero-bubble schedule's input pass (B), waiting
    for its weight pass (W), minus what it held after its forward: one forward and one B, run by
    torch's own ``stage_backward_input`` as PipelineStage runs it, under recompute ``mode``. Live
    storages the layer allocated are counted (LiveBytes); its input, its output and the input
    gradients B returns (sent on to the previous stage) are left out. None when there is no split
    (no input that wants a gradient) or torch has none. ``.grad`` is put back as it was.

    Why: a unit waiting for W keeps what the weight gradients need (each weight op's input) and the
    gradients of the weight ops' outputs (kept in B's param groups), and under recompute what B
    rematerialised for W. Measured on CPU, 4 x 128 tokens, 256 wide: a GPT-2 block holds 1.39x its
    forward's bytes, a Llama block 1.50x; under full recompute 6.0 MiB where the forward kept 0.5.
    """
    try:
        from torch.distributed.pipelining._backward import stage_backward_input
    except ImportError:
        return None
    params = [p for p in layer.parameters() if p.requires_grad]
    inputs = [t for t in as_tuple(x) if isinstance(t, Tensor) and t.requires_grad]
    if not inputs:
        return None
    live = LiveBytes()
    with grads_put_back(params + inputs), _unless_unsplittable(), live:
        out = run_fresh(layer, x, mode)
        outs, grads = grad_outputs(out)
        if not outs:
            return None
        outs = _unviewed(outs)
        out = None
        kept = live.current(exclude={storage_key(o) for o in outs})
        dinputs, _groups = stage_backward_input(outs, grads, inputs, iter(params))
        for o in outs:
            o.detach_()
        outs = grads = None
        return live.current(exclude={storage_key(t) for t in dinputs if isinstance(t, Tensor)}) - kept
    return None  # a layer torch cannot split (RuntimeError): its unit counts as its forward's bytes


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages allocated by operators while active (CPU and meta: best effort).

    Every operator output whose storage is new (not one of the operator's inputs) is tracked until
    the storage dies; the peak of the live total is kept. It cannot see allocator caching or
    workspaces inside kernels, so it is a lower bound of what the process really allocates.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        if making_value():  # a value the stage makes once and keeps: not this micro-batch's memory
            return out
        inputs = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                key = storage_key(t)
                if key not in inputs and key not in self._live:
                    st = t.untyped_storage()
                    self._live[key] = (StorageWeakRef(st), st.nbytes())
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            del self._live[key]
        self.peak = max(self.peak, sum(n for _, n in self._live.values()))
        return out

    def current(self, exclude: Iterable[int] = ()) -> int:
        """Bytes of the tracked storages alive now, less those whose keys are in ``exclude``."""
        skip = set(exclude)
        return sum(n for key, (ref, n) in self._live.items() if not ref.expired() and key not in skip)


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[int, Any]:
    """Transient peak above what was allocated before ``fn`` (torch.cuda memory stats on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base), result
    mode = LiveBytes()
    with mode:
        result = fn()
    return mode.peak, result


@dataclass
class PassResult:
    out: Value
    saved: dict[int, int]  # storage key -> bytes, parameters and constants excluded
    peak_forward: int
    peak_backward: int


def saved_pass(
    layer: nn.Module, x: Value, *, device: torch.device, measure_peaks: bool, mode: str = "none"
) -> PassResult:
    """One forward (and, when measuring peaks, one backward) recording what the layer keeps for backward.

    Each kept storage is counted once however many tensors view it; static storages (the layer's
    parameters, buffers, constants) are left out. Under a recompute ``mode`` the layer keeps what
    checkpoint saves (its inputs) plus, for ``selective``, the operator outputs its policy keeps;
    the tensors it saves inside the checkpointed region are placeholders and hold nothing.
    """
    saved: dict[int, int] = {}

    def keep(t: Tensor) -> None:
        saved[storage_key(t)] = t.untyped_storage().nbytes()

    def pack(t: Tensor) -> Tensor:
        keep(t)
        return t

    def forward() -> Value:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return run_fresh(layer, x, mode, on_keep=keep)

    def kept_activations() -> dict[int, int]:
        # static storages are known after the forward: a batch-free value is made during it
        static = static_storage_keys(layer)
        return {key: nbytes for key, nbytes in saved.items() if key not in static}

    if not measure_peaks:
        out = forward()
        return PassResult(out, kept_activations(), 0, 0)
    peak_f, out = peak_bytes(forward, device)
    kept = kept_activations()
    outs, grads = grad_outputs(out)
    targets = backward_targets(layer, x)
    peak_b = 0
    if outs and targets:
        peak_b = _accumulating_backward_peak(layer, outs, grads, targets, device)
    return PassResult(out, kept, peak_f, peak_b)


def _accumulating_backward_peak(layer: nn.Module, outs: list[Tensor], grads: list[Tensor], targets: list[Tensor],
                                device: torch.device) -> int:
    """The backward's peak as training runs it, plus the layer's gradients: the trainer allocates
    ``.grad`` before the first step, so each gradient the backward computes is a fresh tensor that
    lives until it is added into ``.grad``. Taken with ``torch.autograd.grad`` instead, every fresh
    gradient would stay alive to the end and the peak, less the gradients, would miss the largest of
    them (a 16384 x 192 embedding's dense gradient: 12 MiB on the showcase's first rank).
    ``.grad`` of every target is put back as it was."""
    own = {id(p) for p in layer.parameters()}
    params = [t for t in targets if id(t) in own]
    with grads_put_back(targets):
        for t in targets:
            t.grad = torch.zeros_like(t) if id(t) in own else None
        held = sum(tensor_bytes(p.grad) for p in params)
        peak, _ = peak_bytes(lambda: torch.autograd.backward(outs, grads, inputs=targets), device)
    return peak + held


class StateGuard:
    """Puts modules back as they were: buffers (BatchNorm running stats), ``.grad`` of parameters,
    training flags, RNG state. Used around everything the profiler runs on the user's layers."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = list(modules)

    def __enter__(self) -> "StateGuard":
        self._training = [(m, m.training) for top in self.modules for m in top.modules()]
        self._grads = [(p, p.grad) for top in self.modules for p in top.parameters()]
        self._rng = torch.get_rng_state()
        self._cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return self

    @staticmethod
    def snapshot_buffers(layer: nn.Module) -> list[tuple[Tensor, Tensor]]:
        """Copies of one layer's buffers; taken per layer, so only one layer's worth is held."""
        return [(b, b.detach().clone()) for b in layer.buffers() if b.device.type != "meta"]

    @staticmethod
    def restore_buffers(snapshot: list[tuple[Tensor, Tensor]]) -> None:
        with torch.no_grad():
            for buf, copy in snapshot:
                buf.copy_(copy)

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        for m, flag in self._training:
            m.training = flag
        for p, g in self._grads:
            if p.grad is not g:
                p.grad = g
        torch.set_rng_state(self._rng)
        # after a CUDA error every call into the device fails: let the error that says why pass
        if self._cuda_rng is not None and not (exc is not None and is_device_error(exc)):
            torch.cuda.set_rng_state_all(self._cuda_rng)
