"""The profile pass: what each layer of a LayerSequence costs, measured on the device it will train on.

For every layer: forward and backward time (median and spread of repeated runs after warm-up),
parameter, gradient and optimizer bytes, activation bytes saved for backward per micro-batch, the
transient peak of forward and backward, and the bytes of the value leaving it; and, per activation
recompute mode (``selective``, ``full``), the bytes it keeps and the backward time the recomputation
adds (``LayerCost.recompute``). Each layer runs on its real input: the sequence is run once, layer
after layer, and each output feeds the next layer. Identical layers (same structure key, same input
shapes) are timed once. ``estimate=True`` runs nothing real and prices each layer by a roofline (see
:mod:`autopipe.costs.estimate`).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import keystr, tree_flatten_with_path

from ..choices import RECOMPUTE_MODES
from ..errors import AutopipeError, StaleProfileError
from ..progress import Progress, progress_for
from .accounting import (
    Ledger,
    ParamSizer,
    autocast_weight_bytes,
    layer_cost,
    tied_bytes,
)
from .devices import describe_device, device_spec, rank_threads, dtype_name, slow_16bit_cpu_note, steady_heap
from .estimate import data_free, estimate_layer, meta_copy
from ..graph.tp_plan import whole_weights
from .tp_shape import layer_tp_shape
from .in_model import InModelTiming, charge_in_model, time_in_model
from .layer_costs import LayerCost, Profile, optimizer_state_factor
from .measure import (
    MAX_REPEAT_FACTOR,
    TARGET_SPREAD,
    StateGuard,
    Value,
    as_tuple,
    is_device_error,
    median_seconds,
    recompute_extras,
    saved_pass,
    storage_key,
    tensor_bytes,
    time_layer,
    time_split,
    weight_hold_change,
)

__all__ = ["profile", "check_signature"]


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
    progress: bool | Progress = True,
    tp_shapes: bool = True,
) -> Profile:
    """Measure (or estimate) what each layer of ``seq`` costs per micro-batch.

    Args:
        seq: a LayerSequence from :func:`autopipe.flatten`.
        example_args: one micro-batch's positional inputs, as the model takes them.
        example_kwargs: its keyword inputs.
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
        warmup: untimed runs per measured layer.
        repeats: timed runs per measured layer.
        threads: CPU threads to time with, fixed for the run. Default: what each rank of a CPU job
            runs with (``devices.rank_threads``: ``OMP_NUM_THREADS``, else 1), since a job's ranks
            are single-thread processes and a 2-thread timing of small matmuls underprices them.
        progress: show progress on stderr (a live bar on a terminal, a plain line per phase
            elsewhere: autopipe.progress), or report it to the ``Progress`` given; False: quiet.

        tp_shapes: also follow each layer's sharding for tensor parallelism (``LayerCost.tp``, what
            ``autopipe.costs.tp.at_tp`` prices at a degree): a data-free trace per distinct layer, about a
            third of a small model's profile on CPU. False where no tp > 1 will be planned from this
            profile (``convert`` without ``--tp``): such a profile is refused at tp > 1 in one line.
        reserve: bytes the training runtime holds per rank on this device beyond the model's tensors,
            kept in the profile for the memory model (``autopipe.runtime.checks.reserve.runtime_reserve`` measures
            it once per device; the CLI passes it).

    Every layer is also run under each recompute mode (:mod:`autopipe.graph.recompute`) to fill
    ``LayerCost.recompute``: bytes from the same ledger as ``activation_bytes``, extra backward time
    measured (or, estimating, the roofline time of the recomputed operators).

    The model's weights, gradients, buffers (BatchNorm running statistics), training flags and RNG
    state are the same afterwards.

    Examples:
        >>> import torch, autopipe
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        >>> x = torch.randn(4, 8)
        >>> seq = autopipe.flatten(model, (x,))
        >>> prof = autopipe.profile(seq, (x,), repeats=5, progress=False)
        >>> prof.layers[1].forward_time > 0  # seconds per micro-batch, measured
        True
        >>> # backward keeps the first Linear's input and Tanh's output (the last Linear reads that same tensor)
        >>> [layer.activation_bytes for layer in prof.layers]
        [128, 256, 0]
    """
    layers = list(seq.layers)
    run = _Run.resolve(layers, device=device, dtype=dtype, autocast=autocast, mixed_precision=mixed_precision,
                       estimate=estimate, optimizer=optimizer, warmup=warmup, repeats=repeats, tp_shapes=tp_shapes)
    x: Value = seq.pack_inputs(tuple(example_args), dict(example_kwargs or {}))
    input_bytes = sum(tensor_bytes(t) for t in as_tuple(x))
    infos = list(getattr(seq, "infos", [None] * len(layers)))

    old_threads = torch.get_num_threads()
    if run.device.type == "cpu" and not estimate:
        steady_heap()  # as every CPU rank of a job runs (autopipe.runtime.process.distenv): one allocator state timed
        torch.set_num_threads(threads or rank_threads())
    shown = progress_for(progress)
    weights = _layer_work(infos)
    verb = "estimated" if estimate else "measured"
    try:
        with StateGuard(layers), run.no_data():
            x = _to(x, run.device, estimate=estimate)
            first = x
            walk = _Walk(run, infos, x, whole_weights(seq) if tp_shapes else None)
            with shown.phase("profile", total=len(layers), unit=f"layers {verb}", total_work=sum(weights)) as phase:
                for i, layer in enumerate(layers):
                    try:
                        x = walk.layer(i, layer, x)
                    except RuntimeError as e:
                        if not is_device_error(e):
                            raise
                        raise _device_failed(e, walk.name(i), run.device) from e
                    phase.advance(work=weights[i], what=walk.name(i))
            layer_costs = walk.results()
            tied_time = _tied_grad_time(seq, layers, run.device, run.spec, repeats, estimate)
            sequence = None
            if not estimate:
                sequence = _whole_model(layers, first, run, walk.warnings, shown)
                info = describe_device(run.device)  # with the threads it timed at
    finally:
        torch.set_num_threads(old_threads)

    if sequence is not None:
        # a tied tensor's two gradients are summed where the first of its users finishes its backward
        users = {g.canonical: min(g.layers) for g in getattr(seq, "tied", []) if g.layers}
        tied_at: dict[int, float] = {}
        for name, seconds in tied_time.items():
            if name in users:
                tied_at[users[name]] = tied_at.get(users[name], 0.0) + seconds
        layer_costs, note = charge_in_model(layer_costs, sequence, tied_at)
        walk.warnings.extend([note] if note else [])
    warnings = walk.warnings + ([] if estimate else _noisy(layer_costs))
    amp, tdtype = run.amp, run.dtype
    if run.device.type == "cpu" and not estimate:
        emulated = slow_16bit_cpu_note(dtype_name(amp or tdtype))
        warnings = [*([emulated] if emulated else []), *warnings]
    return Profile(
        layers=layer_costs,
        device=run.spec.info(dtype_name(tdtype)) if estimate else info,
        dtype="float32" if amp is not None else dtype_name(tdtype),
        autocast=dtype_name(amp) if amp is not None else "",
        mode="estimated" if estimate else "measured",
        microbatch=_microbatch(example_args, example_kwargs),
        input_bytes=input_bytes,
        optimizer=optimizer.lower(),
        mixed_precision=mixed_precision,
        torch_version=torch.__version__,
        signature=str(getattr(seq, "signature", "")),
        tied_static_bytes=tied_bytes(seq, layers, run.sizes),
        warnings=tuple(warnings),
        reserve_bytes=int(reserve),
        tied_grad_time=tied_time,
        sequence_forward_time=sum(sequence.forward) if sequence is not None else 0.0,
        sequence_backward_time=sum(sequence.backward) if sequence is not None else 0.0,
        # how disturbed the timings were, in figures (autopipe.costs.noise says so beside each predicted step)
        timing_spread=sequence.spread / sequence.total if sequence is not None and sequence.total > 0 else 0.0,
        twin_ratio=walk.twin_ratio,
        host_load=0.0 if estimate else _load_average(),
    )


@dataclass(frozen=True)
class _Run:
    """How this profile runs: where, in which dtypes, measured or estimated, how often."""

    device: torch.device  # where the layers run (where they were traced)
    home: torch.device  # where their tensors are
    estimate: bool
    spec: Any  # the DeviceSpec estimated for, or None
    dtype: torch.dtype  # the layers' own dtype
    amp: torch.dtype | None  # the 16-bit dtype autocast runs in, or None
    sizes: ParamSizer
    warmup: int
    repeats: int
    tp_shapes: bool = True  # trace each distinct layer's TpShape (profile(tp_shapes=...))

    @classmethod
    def resolve(cls, layers: list[nn.Module], *, device: str | torch.device | None, dtype: str | torch.dtype | None,
                autocast: str | torch.dtype | None, mixed_precision: bool, estimate: bool, optimizer: str,
                warmup: int, repeats: int, tp_shapes: bool = True) -> _Run:
        if warmup < 0 or repeats < 1:
            raise AutopipeError(f"profile: warmup={warmup}, repeats={repeats}; need warmup >= 0 and repeats >= 1.")
        state_factor = optimizer_state_factor(optimizer)
        amp = _autocast_dtype(autocast, mixed_precision, _model_dtype(layers), estimate)
        tdtype = _resolve_dtype(dtype, mixed_precision, _model_dtype(layers))
        home = _home_device(layers)
        spec = None
        if estimate:
            spec = device_spec(str(device or "cpu"), dtype_name(tdtype))
            run_device = home  # the device is baked into the traced graphs: estimate where they were traced
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
        sizes = ParamSizer(torch.float32 if amp is not None else tdtype, mixed_precision, state_factor)
        return cls(run_device, home, estimate, spec, tdtype, amp, sizes, warmup, repeats, tp_shapes)

    def no_data(self) -> contextlib.AbstractContextManager[Any]:
        """Estimating on a real device, the layers run on fake tensors (no data); on meta as they are."""
        if self.estimate and self.home.type != "meta":
            return FakeTensorMode(allow_non_fake_inputs=True)
        return contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.amp is not None and not self.estimate:
            return torch.autocast(self.device.type, dtype=self.amp)
        return contextlib.nullcontext()


class _Walk:
    """The sequence run once, layer after layer, each output feeding the next layer: what each costs."""

    def __init__(self, run: _Run, infos: list[Any], first_input: Value,
                 whole: list[frozenset[str]] | None = None) -> None:  # fmt: skip
        self.run, self.infos = run, infos
        # per layer, the parameters tensor parallelism keeps whole (graph.tp_plan.whole_weights)
        self.whole = whole or [frozenset()] * len(infos)
        n = len(infos)
        # one ledger per recompute mode: what the layers keep for backward, each storage charged once
        self.ledgers = {mode: Ledger(n, as_tuple(first_input)) for mode in RECOMPUTE_MODES}
        self.costs: list[dict[str, Any]] = []
        self.warnings: list[str] = []
        self.twin_ratio = 0.0  # the largest ratio between identical layers timed twice (_check_twin)
        self.measured: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.first_named: dict[tuple[Any, ...], str] = {}
        # identical layers are timed once; the last of each kind is timed again to check that figure
        self.last_of = {info.structure: info.index for info in infos if info is not None and info.structure}

    def name(self, i: int) -> str:
        info = self.infos[i]
        return info.name if info is not None else f"layer{i}"

    def layer(self, i: int, layer: nn.Module, x: Value) -> Value:
        """Cost layer ``i`` on input ``x``; return its output, detached, as the next layer's input."""
        run, info, name = self.run, self.infos[i], self.name(i)
        work, is_copy = _working_layer(layer, run.device, run.estimate)
        snapshot = [] if is_copy else StateGuard.snapshot_buffers(work)
        work.train()  # profile what training runs: dropout on, batch statistics
        structure = info.structure if info is not None else ""
        key = (structure, _signature(x), len(self.whole[i])) if structure else None
        timing = self.measured.get(key) if key is not None else None
        source = "reused" if timing is not None else ("estimated" if run.estimate else "measured")
        with run.autocast():
            if timing is None:
                timing = _cost_layer(work, x, run, self.whole[i])
                if key is not None:
                    self.measured[key] = timing
            inputs = {storage_key(t) for t in as_tuple(x)}
            result = saved_pass(work, x, device=run.device, measure_peaks=source != "reused")
            if source != "reused":
                timing.update(peak_forward_bytes=result.peak_forward, peak_backward_bytes=result.peak_backward)
            self.ledgers["none"].charge(i, result.saved, inputs, result.out, result.out)
            for mode in RECOMPUTE_MODES[1:]:
                # the same input under each mode; the next layer runs on the plain pass's output
                kept = saved_pass(work, x, device=run.device, measure_peaks=False, mode=mode)
                self.ledgers[mode].charge(i, kept.saved, inputs, result.out, kept.out)
                del kept
        if run.amp is not None and run.estimate:
            # no autocast on meta: add the 16-bit weight copies a real run would keep
            copies, kept = autocast_weight_bytes(work, x, run.amp), self.ledgers["none"].bytes[i]
            self.ledgers["none"].bytes[i] += copies
            shape = timing.get("tp")
            if shape is not None and copies and source != "reused":  # the sharded weights' copies are sharded too
                share = (shape.activation_share * kept + shape.param_share * copies) / (kept + copies)
                timing["tp"] = replace(shape, activation_share=share)
        if key is not None:
            self.first_named.setdefault(key, name)
            if source == "reused" and not run.estimate and self.last_of.get(structure) == i:
                self._check_twin(work, x, key, timing, structure, name)
        out = _detached(result.out)
        StateGuard.restore_buffers(snapshot)
        params = list(layer.parameters())  # each tensor once, tied or not
        pb, gb, ob = (sum(v) for v in zip(*(run.sizes(p) for p in params))) if params else (0, 0, 0)
        self.costs.append(dict(
            index=i, name=name, params=sum(p.numel() for p in params),
            param_bytes=pb, grad_bytes=gb, optimizer_bytes=ob,
            output_bytes=sum(tensor_bytes(t) for t in as_tuple(out)),
            tied=tuple(info.tied) if info is not None else (), structure=structure, source=source,
            **timing,
        ))  # fmt: skip
        return out

    def _check_twin(self, work: nn.Module, x: Value, key: tuple[Any, ...], timing: dict[str, Any], structure: str,
                    name: str) -> None:
        """Time the last of a kind of identical layers again: a busy machine shows as disagreement."""
        run = self.run
        with run.autocast():
            check = time_layer(work, x, device=run.device, warmup=run.warmup, repeats=run.repeats)
        first, again = timing["forward_time"] + timing["backward_time"], check.forward + check.backward
        if min(first, again) > 0:
            self.twin_ratio = max(self.twin_ratio, max(first, again) / min(first, again))
        note = _disagreement(self.first_named[key], timing, name, check)
        if not note:
            return
        self.warnings.append(note)
        # the faster is the less disturbed: let every layer of this kind have it
        if check.forward + check.backward < timing["forward_time"] + timing["backward_time"]:
            faster = dict(forward_time=check.forward, backward_time=check.backward,
                          forward_spread=check.forward_spread, backward_spread=check.backward_spread)
            timing.update(faster)
            for c in self.costs:
                if c["structure"] == structure and c["source"] in ("measured", "reused"):
                    c.update(faster)

    def results(self) -> tuple[LayerCost, ...]:
        return tuple(layer_cost(c, self.ledgers) for c in self.costs)


def _cost_layer(work: nn.Module, x: Value, run: _Run, whole: frozenset[str] = frozenset()) -> dict[str, Any]:
    """Seconds of one layer: forward, backward, its split for zero-bubble schedules, each recompute
    mode's extra backward; and what a unit waiting for its weight pass holds (zbv's memory)."""
    device, warmup, repeats = run.device, run.warmup, run.repeats
    if run.estimate:
        dtype = dtype_name(run.amp or run.dtype)
        est = estimate_layer(work, x, spec=run.spec, dtype=dtype)
        # Bytes need no device: what a zbv unit holds awaiting W is counted on meta/fake tensors as
        # measured (a tiny GPT-2 block: none within 2 %, full exactly). Not selective: its count on meta
        # differed by a third from the CPU run's (untraced), so estimates charge selective's kept bytes.
        hold = {mode: weight_hold_change(work, x, mode=mode) for mode in ("none", "full")}
        return dict(forward_time=est.forward_time, backward_time=est.backward_time, flops=est.forward_flops,
                    recompute_time=est.recompute_time, hold_change={m: d for m, d in hold.items() if d is not None},
                    tp=layer_tp_shape(work, x, spec=run.spec, dtype=dtype, whole=whole) if run.tp_shapes else None)
    t = time_layer(work, x, device=device, warmup=warmup, repeats=repeats)
    # what recomputation adds to the backward, timed beside a plain backward (measure.recompute_extras)
    extra = recompute_extras(work, x, RECOMPUTE_MODES[1:], device=device, warmup=warmup, repeats=repeats)
    split = time_split(work, x, device=device, warmup=warmup, repeats=repeats) or (0.0, 0.0)
    # what a unit waiting for its weight pass holds beyond its forward's bytes, per mode (zbv's memory)
    hold = {mode: weight_hold_change(work, x, mode=mode) for mode in RECOMPUTE_MODES}
    return dict(forward_time=t.forward, backward_time=t.backward, tp=_measured_tp_shape(work, x, run, whole) if run.tp_shapes else None,
                forward_spread=t.forward_spread, backward_spread=t.backward_spread, recompute_time=extra,
                backward_input_time=split[0], backward_weight_time=split[1],
                hold_change={m: d for m, d in hold.items() if d is not None})


def _measured_tp_shape(work: nn.Module, x: Value, run: _Run, whole: frozenset[str] = frozenset()) -> Any:
    """A measured layer's TpShape: the same data-free trace (autopipe.costs.tp_shape) on fake copies of
    the layer and its input, in the dtype autocast runs the matmuls in, priced by the H100 roofline
    (only its shares are kept; the layer's own measured seconds are what they divide)."""
    spec = device_spec("h100", "bfloat16")
    dtype = run.amp or run.dtype
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            fake = meta_copy(work, dtype=dtype, device=run.device)
            fx = tuple(data_free(t, run.device, dtype) if isinstance(t, torch.Tensor) else t for t in as_tuple(x))
            fx = fx[0] if not isinstance(x, tuple) else fx
            return layer_tp_shape(fake, fx, spec=spec, dtype=dtype_name(dtype), whole=whole)
    except Exception:  # noqa: BLE001  (no shape: the layer is priced replicated at every degree)
        return None


def _whole_model(layers: list[nn.Module], x: Value, run: _Run, warnings: list[str],
                 shown: Progress) -> InModelTiming | None:  # fmt: skip
    """Each layer's forward and backward inside the whole model on one micro-batch (autopipe.costs.in_model),
    the buffers put back after; None (and a warning) where the device cannot hold it all at once."""
    snapshots = [StateGuard.snapshot_buffers(layer) for layer in layers]
    for layer in layers:
        layer.train()
    try:
        with run.autocast():
            # 1.5x the layers' repeats (15 by default), not half: a plan costs every layer from these
            # runs, and eight profiles of a 6 x 256 GPT-2 on this CPU planned its 2-stage 1F1B step with
            # a 2.6% coefficient of variation from 5 runs, 1.9% from 15 (a Llama: 2.5%, 1.2%;
            # bench/results/profile-draws.md). A run is one micro-batch's forward + backward.
            repeats = max(3, run.repeats + run.repeats // 2)
            with shown.phase("profile: the whole model", total=1 + repeats, unit="runs") as phase:
                def ran(count: int) -> None:
                    if count > (phase.total or 0):  # noisy runs: time_in_model takes more, up to its cap
                        phase.extend(count)
                    phase.set(count)

                return time_in_model(layers, x, device=run.device, warmup=1, repeats=repeats, on_run=ran)
    except RuntimeError as e:
        if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e)):
            raise
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
        warnings.append(f"the whole model's activations for one micro-batch do not fit {run.device} at once, so "
                        "each layer keeps its own figures, not its time inside the model.")  # fmt: skip
        return None
    finally:
        for snapshot in snapshots:
            StateGuard.restore_buffers(snapshot)


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


# ---- helpers ------------------------------------------------------------------------------------


def _device_failed(error: RuntimeError, name: str, device: torch.device) -> AutopipeError:
    """One line for a device that failed while a layer was measured: out of memory, or a CUDA error
    (after which this process cannot use the GPU again)."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in first:
        return AutopipeError(
            f"profiling layer {name} on {device} ran out of device memory ({first}); profile a smaller "
            "micro-batch (--batch-size, --seq-len) and let the planner rescale it, free the device, or --estimate."
        )
    return AutopipeError(
        f"profiling layer {name} on {device} failed with a device error ({first}); the process cannot use the "
        "device after it: fix the cause (CUDA_LAUNCH_BLOCKING=1 names the kernel) and profile again."
    )


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


def _load_average() -> float:
    """The host's 1-minute load average now (0 where the platform has none): what ran beside the
    profile's last minute, its own threads included (autopipe.costs.noise takes them off)."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return 0.0


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


# What a layer weighs in the profile's time left: the first of a kind of identical layers is timed
# (forward and backward, each recompute mode, the zero-bubble split), the last of a kind timed once
# more (a check: about half of that), the others reuse the first's figures and only run once.
_FIRST, _CHECKED, _REUSED = 1.0, 0.5, 0.05


def _layer_work(infos: Sequence[Any]) -> list[float]:
    """Each layer's share of the profile's work, for the ETA (identical layers share a structure key)."""
    seen: set[str] = set()
    last = {info.structure: info.index for info in infos if info is not None and info.structure}
    work = []
    for i, info in enumerate(infos):
        key = info.structure if info is not None else ""
        if not key or key not in seen:
            work.append(_FIRST)
        else:
            work.append(_CHECKED if last.get(key) == i else _REUSED)
        seen.add(key)
    return work
