"""The profile pass: what each layer of a LayerSequence costs, measured on the device it will train on.

For every layer: forward and backward time (median and spread of repeated runs after warm-up),
parameter, gradient and optimizer bytes, activation bytes saved for backward per micro-batch, the
transient peak of forward and backward, and the bytes of the value leaving it; and, per activation
recompute mode (``selective``, ``full``), the bytes it keeps and the backward time the recomputation
adds (``LayerCost.recompute``). Each layer runs on its real input: the sequence is run once, layer
after layer, and each output feeds the next layer. Identical layers (same structure key, same input
shapes) are timed once. ``estimate=True`` runs nothing real and prices each layer by a roofline (see
:mod:`autopipe.estimate`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Mapping, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import keystr, tree_flatten_with_path

from .devices import describe_device, device_spec, dtype_name, keep_freed_memory
from .errors import AutopipeError, StaleProfileError
from .estimate import data_free, estimate_layer, meta_copy
from .measure import (
    MAX_REPEAT_FACTOR,
    TARGET_SPREAD,
    StateGuard,
    Value,
    as_tuple,
    median_seconds,
    saved_pass,
    storage_key,
    tensor_bytes,
    time_layer,
    time_split,
    weight_hold_change,
)
from .records import RECOMPUTE_MODES, LayerCost, Profile, RecomputeCost, optimizer_state_factor
from .units import format_bytes

__all__ = ["profile", "check_signature", "profile_table"]

_COUNTED = -1  # ledger mark: this storage's bytes are already charged to some layer


def profile(
    seq: Any,
    example_args: Sequence[Any] = (),
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    optimizer: str = "adamw",
    mixed_precision: bool = False,
    autocast: str | torch.dtype | None = None,
    reserve: int = 0,
    warmup: int = 3,
    repeats: int = 10,
    estimate: bool = False,
    threads: int | None = None,
    progress: bool = True,
) -> Profile:
    """Measure (or estimate) what each layer of ``seq`` costs per micro-batch.

    Args:
        seq: a LayerSequence from :func:`autopipe.flatten`.
        example_args, example_kwargs: one micro-batch, as the model takes it.
        device: where to measure (default: where the layers are; they must have been traced there).
            With ``estimate=True``, the device to estimate for: ``cpu`` (probed), ``cuda``, ``a100``,
            ``h100``, ``h200``.
        dtype: the dtype the layers are expected in (default: the model's own). A traced graph keeps
            its dtypes, so convert the model before flatten rather than here; a mismatch is an error.
        optimizer: ``adamw``, ``adam``, ``sgd-momentum``, ``sgd`` or ``none``: sizes optimizer state.
        mixed_precision: the (16-bit) parameters and gradients come with fp32 master weights and
            fp32 optimizer state.
        autocast: ``bfloat16`` or ``float16``: profile as ``train.py --dtype bf16|fp16`` trains, fp32
            layers run under ``torch.autocast``. Times are autocast's; activations include the
            16-bit copy of each weight autocast keeps per micro-batch; parameters, gradients and
            optimizer state are fp32. Estimating (no autocast on meta tensors), the layers run in
            their own dtype (convert the model to 16 bits first for 16-bit activations) and the
            weight copies are added from the parameters each matmul-like operator reads.
        warmup, repeats: untimed and timed runs per measured layer.
        threads: CPU threads to time with (default: torch's current setting), fixed for the run.
        progress: show a progress bar on stderr.

        reserve: bytes the training runtime holds per rank on this device beyond the model's tensors,
            kept in the profile for the memory model (``autopipe.reserve.runtime_reserve`` measures
            it once per device; the CLI passes it).

    Every layer is also run under each recompute mode (:mod:`autopipe.recompute`) to fill
    ``LayerCost.recompute``: bytes from the same ledger as ``activation_bytes``, extra backward time
    measured (or, estimating, the roofline time of the recomputed operators).

    The model's weights, gradients, buffers (BatchNorm running statistics), training flags and RNG
    state are the same afterwards.

    Example:
        >>> seq = autopipe.flatten(model, (ids,))
        >>> prof = autopipe.profile(seq, (ids,), repeats=5)
        >>> prof.layers[1].forward_time, prof.layers[1].activation_bytes
    """
    state_factor = optimizer_state_factor(optimizer)
    if warmup < 0 or repeats < 1:
        raise AutopipeError(f"profile: warmup={warmup}, repeats={repeats}; need warmup >= 0 and repeats >= 1.")
    layers = list(seq.layers)
    amp = _autocast_dtype(autocast, mixed_precision, _model_dtype(layers), estimate)
    tdtype = _resolve_dtype(dtype, mixed_precision, _model_dtype(layers))
    home = _home_device(layers)
    spec = None
    no_data: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if estimate:
        spec = device_spec(str(device or "cpu"), dtype_name(tdtype))
        # Run where the layers were traced (the device is baked into their graphs), with no data:
        # on meta as they are, or as fake tensors on a real device.
        run_device = home
        if home.type != "meta":
            no_data = FakeTensorMode(allow_non_fake_inputs=True)
    else:
        run_device = torch.device(device) if device is not None else home
        if run_device.type == "meta":
            raise AutopipeError("profile: the layers are on the meta device (no weights); use estimate=True.")
        if run_device.type != home.type:
            # Traced graphs bake in their device (arange(device=cpu)), so a copy would not run there.
            raise AutopipeError(
                f"profile: the layers were traced on {home.type} but device={device!r}; move the model and "
                f"its example inputs to {run_device.type} and flatten again, then profile."
            )
    # under autocast the parameters, gradients and optimizer state are fp32, whatever the layers hold
    sizes = _ParamSizer(torch.float32 if amp is not None else tdtype, mixed_precision, state_factor)
    in_autocast = (
        (lambda: torch.autocast(run_device.type, dtype=amp)) if amp is not None and not estimate else contextlib.nullcontext
    )

    x: Value = seq.pack_inputs(tuple(example_args), dict(example_kwargs or {}))
    input_bytes = sum(tensor_bytes(t) for t in as_tuple(x))
    infos = list(getattr(seq, "infos", [None] * len(layers)))

    old_threads = torch.get_num_threads()
    if run_device.type == "cpu" and not estimate:
        keep_freed_memory()  # else page faults, not the layers, dominate CPU timings
    if run_device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    costs: list[dict[str, Any]] = []
    # one ledger per recompute mode: what the layers keep for backward, each storage charged once
    ledgers: dict[str, _Ledger] = {}
    measured: dict[tuple[Any, ...], dict[str, Any]] = {}
    first_named: dict[tuple[Any, ...], str] = {}
    # identical layers are timed once; the last of each kind is timed again to check that figure
    last_of = {info.structure: info.index for info in infos if info is not None and info.structure}
    warnings: list[str] = []
    try:
        with StateGuard(layers), _progress_bar(progress, len(layers)) as bar, no_data:
            x = _to(x, run_device, estimate=estimate)
            ledgers = {mode: _Ledger(len(layers), as_tuple(x)) for mode in RECOMPUTE_MODES}
            task = bar.add_task("profile", total=len(layers))
            for i, layer in enumerate(layers):
                info = infos[i]
                name = info.name if info is not None else f"layer{i}"
                bar.update(task, description=f"{'estimate' if estimate else 'measure'} {name}")
                work, is_copy = _working_layer(layer, run_device, estimate)
                snapshot = [] if is_copy else StateGuard.snapshot_buffers(work)
                work.train()  # profile what training runs: dropout on, batch statistics
                structure = info.structure if info is not None else ""
                key = (structure, _signature(x)) if structure else None
                timing = measured.get(key) if key is not None else None
                source = "reused" if timing is not None else ("estimated" if estimate else "measured")
                with in_autocast():
                    if timing is None:
                        timing = _cost_layer(work, x, estimate=estimate, spec=spec,
                                             dtype=dtype_name(amp or tdtype), device=run_device,
                                             warmup=warmup, repeats=repeats)
                        if key is not None:
                            measured[key] = timing
                    inputs = {storage_key(t) for t in as_tuple(x)}
                    result = saved_pass(work, x, device=run_device, measure_peaks=source != "reused")
                    if source != "reused":
                        timing.update(peak_forward_bytes=result.peak_forward, peak_backward_bytes=result.peak_backward)
                    ledgers["none"].charge(i, result.saved, inputs, result.out, result.out)
                    for mode in RECOMPUTE_MODES[1:]:
                        # the same input under each mode; the next layer runs on the plain pass's output
                        kept = saved_pass(work, x, device=run_device, measure_peaks=False, mode=mode)
                        ledgers[mode].charge(i, kept.saved, inputs, result.out, kept.out)
                        del kept
                if amp is not None and estimate:
                    # no autocast on meta: add the 16-bit weight copies a real run would keep
                    ledgers["none"].bytes[i] += _autocast_weight_bytes(work, x, amp)
                if key is not None:
                    first_named.setdefault(key, name)
                if source == "reused" and not estimate and last_of.get(structure) == i:
                    with in_autocast():
                        check = time_layer(work, x, device=run_device, warmup=warmup, repeats=repeats)
                    note = _disagreement(first_named[key], timing, name, check)
                    if note:
                        warnings.append(note)
                        # the faster is the less disturbed: let every layer of this kind have it
                        if check.forward + check.backward < timing["forward_time"] + timing["backward_time"]:
                            timing.update(forward_time=check.forward, backward_time=check.backward,
                                          forward_spread=check.forward_spread, backward_spread=check.backward_spread)
                            for c in costs:
                                if c["structure"] == structure and c["source"] in ("measured", "reused"):
                                    c.update(forward_time=check.forward, backward_time=check.backward,
                                             forward_spread=check.forward_spread, backward_spread=check.backward_spread)
                x = _detached(result.out)
                StateGuard.restore_buffers(snapshot)
                params = list(layer.parameters())  # each tensor once, tied or not
                pb, gb, ob = (sum(v) for v in zip(*(sizes(p) for p in params))) if params else (0, 0, 0)
                costs.append(dict(
                    index=i, name=name, params=sum(p.numel() for p in params),
                    param_bytes=pb, grad_bytes=gb, optimizer_bytes=ob,
                    output_bytes=sum(tensor_bytes(t) for t in as_tuple(x)),
                    tied=tuple(info.tied) if info is not None else (), structure=structure, source=source,
                    **timing,
                ))
                del result, work
                bar.advance(task)
    finally:
        torch.set_num_threads(old_threads)

    layer_costs = tuple(_layer_cost(c, ledgers) for c in costs)
    if not estimate:
        warnings += _noisy(layer_costs)
    return Profile(
        layers=layer_costs,
        device=spec.info(dtype_name(tdtype)) if estimate else describe_device(run_device),
        dtype="float32" if amp is not None else dtype_name(tdtype),
        autocast=dtype_name(amp) if amp is not None else "",
        mode="estimated" if estimate else "measured",
        microbatch=_microbatch(example_args, example_kwargs),
        input_bytes=input_bytes,
        optimizer=optimizer.lower(),
        mixed_precision=mixed_precision,
        torch_version=torch.__version__,
        signature=str(getattr(seq, "signature", "")),
        tied_static_bytes=_tied_bytes(seq, layers, sizes),
        warnings=tuple(warnings),
        reserve_bytes=int(reserve),
        tied_grad_time=_tied_grad_time(seq, layers, run_device, spec, repeats, estimate),
    )


def _tied_grad_time(
    seq: Any, layers: list[nn.Module], device: torch.device, spec: Any, repeats: int, estimate: bool
) -> dict[str, float]:
    """Seconds to sum two gradients of each tied tensor: what the unsplit model pays in backward.

    GPT-2's 154 MB wte/lm_head sum is ~10% of its CPU step; per-layer times cannot contain it.
    """
    out: dict[str, float] = {}
    for group in getattr(seq, "tied", []):
        tensor = next(
            (layer.get_parameter(n) for layer in layers for n, _ in layer.named_parameters() if n in group.names), None
        )
        if tensor is None:
            continue
        if estimate:
            # Read two, write one, at the device's memory bandwidth.
            out[group.canonical] = 3 * tensor_bytes(tensor) / spec.memory_bandwidth if spec.memory_bandwidth else 0.0
            continue
        a = torch.ones(tensor.shape, dtype=tensor.dtype, device=device)
        b = torch.ones_like(a)
        out[group.canonical] = median_seconds(lambda: a + b, device=device, repeats=max(3, repeats // 2))
    return out


def check_signature(profile: Profile, seq: Any) -> None:
    """Refuse a profile made for another model or other flatten options than ``seq``'s.

    Raises:
        StaleProfileError: with both signatures and how to get a matching profile.
    """
    expected = str(getattr(seq, "signature", ""))
    if profile.signature and profile.signature != expected:
        raise StaleProfileError(
            f"the profile was made for signature {profile.signature} but this model/flatten options give "
            f"{expected}: the model or the flatten options changed since it was measured. "
            "Profile again (autopipe profile MODEL --out profile.json) with the same model and options."
        )
    if len(profile.layers) != len(seq.layers):
        raise StaleProfileError(
            f"the profile has {len(profile.layers)} layers but the sequence has {len(seq.layers)}; "
            "profile this sequence again."
        )


def profile_table(prof: Profile) -> Table:
    """A rich table of a profile, one row per layer: time share, memory, bytes out.

    ``act`` is what a layer keeps for backward; the caption adds what the whole model keeps under
    each recompute mode and the backward time it adds (per layer: ``LayerCost.recompute``, in the JSON).
    """
    total = sum(prof.times) or 1.0
    table = Table(title=f"{prof.model or 'model'}: {prof.mode} on {prof.device.name} ({prof.dtype})",
                  title_justify="left")
    modes = [m for m in RECOMPUTE_MODES[1:] if any(m in c.recompute for c in prof.layers)]
    # static = parameters + gradients + optimizer state; act = saved for backward per micro-batch
    for col in ("#", "layer", "fwd ms", "bwd ms", "share", "static", "act", "peak", "out", ""):
        table.add_column(col, justify="left" if col in ("layer", "") else "right", no_wrap=col != "layer",
                         min_width=12 if col == "layer" else None)
    for c in prof.layers:
        table.add_row(
            str(c.index), c.name, f"{c.forward_time * 1e3:.3f}", f"{c.backward_time * 1e3:.3f}",
            f"{100 * c.time / total:.1f}%", format_bytes(c.static_bytes), format_bytes(c.activation_bytes),
            format_bytes(max(c.peak_forward_bytes, c.peak_backward_bytes)), format_bytes(c.output_bytes),
            ("tied " if c.tied else "") + ("=" if c.source == "reused" else ""),
        )
    activations = sum(c.activation_bytes for c in prof.layers)
    lines = [f"total {total * 1e3:.2f} ms per micro-batch {prof.microbatch}; activations "
             f"{format_bytes(activations)}; '=' reuses an identical layer"]
    for m in modes:
        kept = sum(c.recompute[m].activation_bytes if m in c.recompute else c.activation_bytes for c in prof.layers)
        extra = sum(c.recompute[m].extra_backward_time for c in prof.layers if m in c.recompute)
        lines.append(f"{m} recompute: activations {format_bytes(kept)} ({100 * kept / (activations or 1):.0f}%), "
                     f"backward +{extra * 1e3:.2f} ms ({100 * extra / total:.0f}% of the step)")
    table.caption = "\n".join(lines)
    return table


# ---- helpers ------------------------------------------------------------------------------------


class _Ledger:
    """Activation bytes per layer under one recompute mode: each kept storage is charged once, to the
    layer that produced it (the model's inputs to layer 0).

    So a run of layers sums to what they keep, each storage once, however many layers keep it: under
    ``full`` a layer keeps its input, which its producer pays for, and a chunk's sum is what its stage
    keeps for backward besides its input tuple (its output tuple included: the stage holds it anyway).
    """

    def __init__(self, num_layers: int, first_input: Sequence[Tensor]) -> None:
        self.bytes = [0] * num_layers
        # storage key of each tensor of the current input -> layer to charge if a layer keeps it
        self.owner = {storage_key(t): 0 for t in first_input}

    def charge(self, i: int, saved: Mapping[int, int], inputs: set[int], out: Value, own_out: Value) -> None:
        """Charge what layer ``i`` kept (``saved``); ``out`` feeds the next layer, ``own_out`` is the
        same output from the pass that kept ``saved`` (the same storages, or a recompute mode's run)."""
        for key, nbytes in saved.items():
            if key in inputs:
                if self.owner.get(key, _COUNTED) != _COUNTED:
                    self.bytes[self.owner[key]] += nbytes
                    self.owner[key] = _COUNTED
            else:
                self.bytes[i] += nbytes
        # Who pays for each storage of the output if a later layer keeps it: a storage passed through
        # unchanged keeps its producer; one layer i kept itself is paid for; a new one is i's.
        self.owner = {
            storage_key(t): (self.owner.get(storage_key(t), _COUNTED) if storage_key(t) in inputs
                             else _COUNTED if storage_key(own) in saved else i)
            for t, own in zip(as_tuple(out), as_tuple(own_out))
        }


def _layer_cost(c: dict[str, Any], ledgers: Mapping[str, _Ledger]) -> LayerCost:
    i = c["index"]
    extra = c.pop("recompute_time", {})
    change = c.pop("hold_change", {})
    recompute = {
        mode: RecomputeCost(activation_bytes=ledgers[mode].bytes[i], extra_backward_time=extra.get(mode, 0.0))
        for mode in RECOMPUTE_MODES[1:]
    }
    # on the same ledger as the activations: what the layer keeps, plus what waiting for W changes
    hold = {mode: max(0, ledgers[mode].bytes[i] + d) for mode, d in change.items()}
    return LayerCost(activation_bytes=ledgers["none"].bytes[i], recompute=recompute, weight_hold_bytes=hold, **c)


def _cost_layer(work: nn.Module, x: Value, *, estimate: bool, spec: Any, dtype: str, device: torch.device,
                warmup: int, repeats: int) -> dict[str, Any]:
    if estimate:
        est = estimate_layer(work, x, spec=spec, dtype=dtype)
        # Bytes need no device: what a zbv unit holds awaiting W is counted on meta/fake tensors as
        # measured (a tiny GPT-2 block: none within 2 %, full exactly). Not selective: its count on meta
        # differed by a third from the CPU run's (untraced), so estimates charge selective's kept bytes.
        hold = {mode: weight_hold_change(work, x, mode=mode) for mode in ("none", "full")}
        return dict(forward_time=est.forward_time, backward_time=est.backward_time, flops=est.forward_flops,
                    recompute_time=est.recompute_time, hold_change={m: d for m, d in hold.items() if d is not None})
    t = time_layer(work, x, device=device, warmup=warmup, repeats=repeats)
    # what recomputation adds to the backward: its median under the mode minus the plain median;
    # noise can make it negative on a cheap layer, where it is nothing
    extra = {
        mode: max(0.0, time_layer(work, x, device=device, warmup=warmup, repeats=repeats, mode=mode).backward
                  - t.backward)
        for mode in RECOMPUTE_MODES[1:]
    }
    split = time_split(work, x, device=device, warmup=warmup, repeats=repeats) or (0.0, 0.0)
    # what a unit waiting for its weight pass holds beyond its forward's bytes, per mode (zbv's memory)
    hold = {mode: weight_hold_change(work, x, mode=mode) for mode in RECOMPUTE_MODES}
    return dict(forward_time=t.forward, backward_time=t.backward,
                forward_spread=t.forward_spread, backward_spread=t.backward_spread, recompute_time=extra,
                backward_input_time=split[0], backward_weight_time=split[1],
                hold_change={m: d for m, d in hold.items() if d is not None})


class _ParamSizer:
    """Parameter, gradient and optimizer-state bytes of one parameter under the chosen training setup."""

    def __init__(self, dtype: torch.dtype | None, mixed: bool, state_factor: float) -> None:
        self.dtype, self.mixed, self.state_factor = dtype, mixed, state_factor

    def __call__(self, p: Tensor) -> tuple[int, int, int]:
        n = p.numel()
        size = _element_size(self.dtype) if self.dtype is not None and p.is_floating_point() else p.element_size()
        if not p.requires_grad:
            return n * size, 0, 0
        if self.mixed and p.is_floating_point():
            # fp32 master copy plus fp32 optimizer state: what mixed-precision training keeps.
            return n * size, n * size, int(n * 4 * (1 + self.state_factor))
        return n * size, n * size, int(n * size * self.state_factor)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# Identical layers whose timings differ by more than this factor (and more than their spreads)
# disagree: the machine was busy during one of them.
DISAGREE = 1.25


def _disagreement(first: str, timing: Mapping[str, Any], name: str, check: Any) -> str:
    """A warning when a re-timed layer disagrees with its identical twin's timing, else ""."""
    a = timing["forward_time"] + timing["backward_time"]
    b = check.forward + check.backward
    spread = timing.get("forward_spread", 0.0) + timing.get("backward_spread", 0.0) + check.forward_spread + check.backward_spread
    lo, hi = min(a, b), max(a, b)
    if lo <= 0 or hi <= DISAGREE * lo or hi - lo <= spread:
        return ""
    return (f"identical layers {first} and {name} measured {lo * 1e3:.3g} and {hi * 1e3:.3g} ms per micro-batch "
            f"({hi / lo:.1f}x apart): the machine was busy while profiling; both now use the faster figure. "
            "Profile again on a quiet machine for firmer times.")


def _noisy(layers: Sequence[LayerCost]) -> list[str]:
    """One warning naming the layers whose timings stayed noisy after the extra repeats."""
    bad = []
    for c in layers:
        if c.source != "measured" or c.time <= 0:
            continue
        rel = (c.forward_spread + c.backward_spread) / c.time
        if rel > 2 * TARGET_SPREAD:
            bad.append((rel, c.name))
    if not bad:
        return []
    worst = max(bad)
    return [f"timings of {len(bad)} layer(s) stayed noisy after {MAX_REPEAT_FACTOR}x the repeats (interquartile "
            f"range up to {worst[0]:.0%} of the median, at {worst[1]}): other work was running; profile again on "
            "a quiet machine, or with more --repeats."]


def _autocast_dtype(
    autocast: str | torch.dtype | None, mixed: bool, model_dtype: torch.dtype, estimate: bool
) -> torch.dtype | None:
    """The 16-bit dtype autocast runs in, or None; checks it fits the layers."""
    if autocast is None or autocast == "":
        return None
    if isinstance(autocast, str):
        name = {"bf16": "bfloat16", "fp16": "float16"}.get(autocast, autocast.removeprefix("torch."))
        amp = getattr(torch, name, None)
    else:
        amp = autocast
    if amp not in (torch.bfloat16, torch.float16):
        raise AutopipeError(f"autocast={autocast!r}; use bfloat16 or float16 (or None for no autocast).")
    if mixed:
        raise AutopipeError("give autocast (fp32 layers, 16-bit matmuls) or mixed_precision (16-bit layers), not both.")
    if not estimate and model_dtype != torch.float32:
        raise AutopipeError(
            f"autocast trains fp32 parameters but the layers are {dtype_name(model_dtype)}; flatten the fp32 model "
            "(train.py keeps fp32 master weights and runs autocast), or profile without autocast."
        )
    return amp


# matmul-like operators autocast runs in 16 bits, casting their weight arguments (and keeping the copy)
_LOW_PRECISION_OPS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "_convolution", "addbmm",
                      "conv1d", "conv2d", "conv3d"}  # fmt: skip


def _autocast_weight_bytes(layer: nn.Module, x: Value, amp: torch.dtype) -> int:
    """Bytes of the 16-bit weight copies autocast would keep for one micro-batch of ``layer``: each
    weight matrix (or kernel) a matmul-like operator reads, once. Biases are cast too, but backward
    does not need them, so nothing keeps their copy."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    params = {storage_key(p): p.numel() for p in layer.parameters() if p.is_floating_point() and p.dim() >= 2}
    used: set[int] = set()

    class _Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            if func.overloadpacket.__name__ in _LOW_PRECISION_OPS:
                used.update(k for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)
                            and (k := storage_key(t)) in params)  # fmt: skip
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), _Reads():
        layer(x)
    return sum(params[k] for k in used) * torch.empty((), dtype=amp).element_size()


def _resolve_dtype(dtype: str | torch.dtype | None, mixed: bool, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the layers are in. A traced graph fixes its dtypes (it asserts them), so the profiler
    cannot cast: the model is converted before flatten, and ``dtype`` only states what is expected."""
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(resolved, torch.dtype):
            raise AutopipeError(f"unknown dtype {dtype!r}; use float32, bfloat16 or float16.")
        dtype = resolved
    if dtype is not None and dtype != model_dtype:
        raise AutopipeError(
            f"profile: dtype={dtype_name(dtype)} but the layers are {dtype_name(model_dtype)}; a traced graph "
            f"keeps its dtypes, so convert the model first (model.to(torch.{dtype_name(dtype)})) and flatten again."
        )
    if mixed and model_dtype.itemsize != 2:
        raise AutopipeError(
            f"mixed precision trains 16-bit parameters but the layers are {dtype_name(model_dtype)}; convert the "
            "model first (model.to(torch.bfloat16)) and flatten again."
        )
    return model_dtype


def _home_device(layers: list[nn.Module]) -> torch.device:
    for layer in layers:
        for t in (*layer.parameters(), *layer.buffers()):
            return t.device
    return torch.device("cpu")


def _model_dtype(layers: list[nn.Module]) -> torch.dtype:
    for layer in layers:
        for p in layer.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.float32


def _working_layer(layer: nn.Module, device: torch.device, estimate: bool) -> tuple[nn.Module, bool]:
    """The layer to run: the user's own when measuring, a copy without data when estimating."""
    if estimate:
        return meta_copy(layer, None, device), True
    return layer, False


def _to(x: Value, device: torch.device, *, estimate: bool) -> Value:
    def move(t: Tensor) -> Tensor:
        if estimate:
            return data_free(t, device)
        return t.detach().to(device=device).requires_grad_(t.requires_grad)

    return tuple(move(t) for t in x) if isinstance(x, (tuple, list)) else move(x)


def _detached(out: Value) -> Value:
    """The next layer's input: same storages (so the ledger can follow them), no graph behind."""
    def cut(t: Tensor) -> Tensor:
        return t.detach().requires_grad_(t.requires_grad)

    return tuple(cut(t) for t in out) if isinstance(out, (tuple, list)) else cut(out)


def _signature(x: Value) -> tuple[Any, ...]:
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in as_tuple(x))


def _microbatch(args: Sequence[Any], kwargs: Mapping[str, Any] | None) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for path, leaf in tree_flatten_with_path((tuple(args), dict(kwargs or {})))[0]:
        if isinstance(leaf, Tensor):
            # path is ((args|kwargs index), then the position/key): "args[0]" / "input_ids"
            head, rest = path[0].idx, path[1:]
            label = keystr(rest).lstrip("[").rstrip("]").strip("'") if head == 1 else f"args{keystr(rest)}"
            shapes[label] = list(leaf.shape)
    return shapes


def _tied_bytes(seq: Any, layers: list[nn.Module], sizes: _ParamSizer) -> dict[str, int]:
    out: dict[str, int] = {}
    for group in getattr(seq, "tied", []) or []:
        names = set(group.names)
        for li in group.layers:
            found = [p for n, p in layers[li].named_parameters(remove_duplicate=False) if n in names]
            if found:
                out[group.canonical] = sum(sizes(found[0]))
                break
    return out


def _progress_bar(enabled: bool, total: int) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
        disable=not enabled,
    )
