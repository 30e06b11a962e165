"""The profile pass on toy sequences whose costs are known exactly: sleeps, parameter and activation sizes."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import Tensor, nn

import autopipe
from autopipe.costs.layer_costs import Profile
from autopipe.costs.profiler import check_signature
from autopipe.errors import AutopipeError, StaleProfileError

B = 8  # micro-batch rows


@torch.library.custom_op("autopipe_test::sleep", mutates_args=())
def _sleep(x: Tensor, seconds: float) -> Tensor:
    time.sleep(seconds)
    return x.clone()


@_sleep.register_fake
def _(x: Tensor, seconds: float) -> Tensor:
    return torch.empty_like(x)


def _sleep_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    ctx.seconds = inputs[1]


def _sleep_backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def]
    # Backward costs twice the forward, like a matmul layer.
    return _sleep(grad, 2 * ctx.seconds), None


_sleep.register_autograd(_sleep_backward, setup_context=_sleep_setup)


class Sleep(nn.Module):
    """A layer of known cost: sleeps ``seconds`` forward and twice that backward."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.scale = nn.Parameter(torch.ones(()))  # so layer 0 has something to differentiate

    def forward(self, x: Tensor) -> Tensor:
        return _sleep(x * self.scale, self.seconds)


def _flatten(model: nn.Module, x: Tensor):  # type: ignore[no-untyped-def]
    return autopipe.flatten(model, (x,))


def test_sleep_layers_measure_their_known_time() -> None:
    """Forward and backward medians of sleeping layers match the sleep, within scheduler noise."""
    x = torch.randn(B, 4)
    seq = _flatten(nn.Sequential(Sleep(0.03), Sleep(0.01)), x)
    prof = autopipe.profile(seq, (x,), warmup=1, repeats=5, progress=False)
    for layer, seconds in zip(prof.layers, (0.03, 0.01)):
        assert seconds * 0.95 <= layer.forward_time <= seconds * 1.5 + 0.01, layer
        assert 2 * seconds * 0.95 <= layer.backward_time <= 2 * seconds * 1.5 + 0.01, layer
        assert layer.source == "measured"
    # The slow layer is seen as slow: what the partitioner balances.
    assert prof.layers[0].time > 2 * prof.layers[1].time


def test_known_parameter_optimizer_and_activation_bytes() -> None:
    """Linear/Tanh/Linear: exact parameter, gradient, AdamW state, saved-activation and output bytes."""
    torch.manual_seed(0)
    x = torch.randn(B, 32)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 16))
    seq = _flatten(model, x)
    prof = autopipe.profile(seq, (x,), warmup=0, repeats=1, progress=False)
    l0, l1, l2 = prof.layers
    assert (l0.params, l1.params, l2.params) == (32 * 64 + 64, 0, 64 * 16 + 16)
    assert (l0.param_bytes, l0.grad_bytes, l0.optimizer_bytes) == (2112 * 4, 2112 * 4, 2 * 2112 * 4)
    assert (l2.param_bytes, l2.grad_bytes, l2.optimizer_bytes) == (1040 * 4, 1040 * 4, 2 * 1040 * 4)
    # Linear saves its input; Tanh saves its output, which the next Linear saves again (counted once);
    # a layer's parameters are never activations.
    assert [l.activation_bytes for l in prof.layers] == [B * 32 * 4, B * 64 * 4, 0]
    assert [l.output_bytes for l in prof.layers] == [B * 64 * 4, B * 64 * 4, B * 16 * 4]
    assert prof.input_bytes == B * 32 * 4
    for layer in prof.layers:
        assert layer.peak_forward_bytes >= layer.output_bytes  # the output is allocated in forward
    assert l0.peak_backward_bytes >= l0.grad_bytes  # the weight gradient is allocated in backward


def test_activation_sum_equals_whole_model_saved_bytes() -> None:
    """Per-layer activation bytes add up to the whole sequence's saved-tensor bytes, each storage once."""
    torch.manual_seed(0)
    x = torch.randn(B, 16)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Sigmoid(), nn.Linear(32, 8))
    seq = _flatten(model, x)
    prof = autopipe.profile(seq, (x,), warmup=0, repeats=1, progress=False)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = seq(x)
    assert sum(l.activation_bytes for l in prof.layers) == sum(saved.values()) > 0
    del out


@pytest.mark.parametrize(
    "optimizer, mixed, expected",
    [
        ("adamw", False, (880, 880, 1760)),
        ("sgd-momentum", False, (880, 880, 880)),
        ("sgd", False, (880, 880, 0)),
        # bf16 parameters and gradients; fp32 master weights and two fp32 Adam states
        ("adamw", True, (440, 440, 220 * 4 * 3)),
    ],
)
def test_optimizer_state_and_mixed_precision_bytes(optimizer: str, mixed: bool, expected: tuple[int, int, int]) -> None:
    """Parameter/gradient/optimizer bytes follow the optimizer and mixed precision (220 elements)."""
    dtype = torch.bfloat16 if mixed else torch.float32
    x = torch.randn(B, 10, dtype=dtype)
    model = nn.Sequential(nn.Linear(10, 20)).to(dtype)  # mixed precision: convert before flatten
    seq = _flatten(model, x)
    prof = autopipe.profile(seq, (x,), optimizer=optimizer, mixed_precision=mixed, warmup=0, repeats=1,
                            progress=False)
    layer = prof.layers[0]
    assert (layer.param_bytes, layer.grad_bytes, layer.optimizer_bytes) == expected
    assert prof.dtype == ("bfloat16" if mixed else "float32") and prof.mixed_precision == mixed


def test_model_state_unchanged_after_profiling() -> None:
    """Weights, gradients, BatchNorm running stats, training flags and the RNG are as they were."""
    torch.manual_seed(0)
    x = torch.randn(B, 8)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    model(x).sum().backward()  # the user has gradients accumulated
    model[2].eval()  # and a mix of training flags
    seq = _flatten(model, x)
    state = copy.deepcopy(model.state_dict())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    flags = [m.training for m in model.modules()]
    seq_flags = [m.training for m in seq.modules()]
    rng = torch.get_rng_state()

    autopipe.profile(seq, (x,), warmup=1, repeats=2, progress=False)

    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name]), name
    assert [m.training for m in model.modules()] == flags
    assert [m.training for m in seq.modules()] == seq_flags
    assert torch.equal(torch.get_rng_state(), rng)
    # The restore is needed: running the sequence in training mode does move the running stats.
    seq.train()
    seq(x)
    assert not torch.equal(model[1].running_mean, state["1.running_mean"])


def test_identical_layers_measured_once() -> None:
    """Layers with one structure and input signature are timed once; the rest reuse it."""
    x = torch.randn(B, 32)
    seq = _flatten(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), x)
    prof = autopipe.profile(seq, (x,), warmup=0, repeats=2, progress=False)
    # Layer 0's input needs no gradient, the others' do: two signatures, two measurements.
    assert [l.source for l in prof.layers] == ["measured", "measured", "reused", "reused"]
    own = [(l.forward_time, l.backward_time) for l in prof.layers]
    assert own[2] == own[3] == own[1]  # (each carries its own time inside the model on top: autopipe.costs.in_model)
    # Each Linear's output is saved by the next Linear and charged to its producer; the last's is not.
    assert [l.activation_bytes for l in prof.layers] == [B * 32 * 4 * 2, B * 32 * 4, B * 32 * 4, 0]


def test_profile_json_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A saved profile loads back equal, whole-profile fields included."""
    x = torch.randn(B, 8)
    seq = _flatten(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), x)
    prof = autopipe.profile(seq, (x,), warmup=0, repeats=2, progress=False)
    prof.save(tmp_path / "p.json")
    loaded = Profile.load(tmp_path / "p.json")
    assert loaded == prof
    assert loaded.signature == seq.signature and loaded.mode == "measured"
    assert loaded.microbatch == {"args[0]": [B, 8]} and loaded.torch_version == torch.__version__


def test_stale_profile_is_refused() -> None:
    """A profile of another model is refused with both signatures; the matching one is accepted."""
    x = torch.randn(B, 8)
    seq_a = _flatten(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), x)
    seq_b = _flatten(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 3)), x)
    prof = autopipe.profile(seq_a, (x,), warmup=0, repeats=1, progress=False)
    check_signature(prof, seq_a)
    with pytest.raises(StaleProfileError) as err:
        check_signature(prof, seq_b)
    assert seq_a.signature in str(err.value) and seq_b.signature in str(err.value)
    assert "profile again" in str(err.value).lower()


def test_bad_options_are_clear_errors() -> None:
    """Unknown optimizer, fp32 mixed precision, a dtype the graph was not traced in, and zero repeats
    raise AutopipeError, not torch errors."""
    x = torch.randn(B, 8)
    seq = _flatten(nn.Sequential(nn.Linear(8, 2)), x)
    for kwargs in ({"optimizer": "lion"}, {"mixed_precision": True}, {"dtype": "bfloat16"}, {"repeats": 0},
                   {"device": "meta"}):
        with pytest.raises(AutopipeError):
            autopipe.profile(seq, (x,), progress=False, **kwargs)


class _Block(nn.Module):
    """Linear(d, 4d) -> GELU -> Linear(4d, d), two of them: the second sees a 16-bit input under autocast."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_autocast_profile_is_what_train_py_holds() -> None:
    """autocast=bfloat16 on fp32 layers: parameters, gradients and AdamW state are fp32 (4+4+8 bytes a
    parameter) and each layer keeps, besides what a bf16 model keeps, a bf16 copy of each weight; the
    estimate (no autocast on meta) adds the same copies from the parameters its matmuls read."""
    d, rows = 32, 8
    torch.manual_seed(0)
    model = _Block(d)
    x = torch.randn(rows, d)
    seq = autopipe.flatten(model, (x,))
    amp = autopipe.profile(seq, (x,), autocast="bfloat16", repeats=1, warmup=0, progress=False)
    assert (amp.dtype, amp.autocast) == ("float32", "bfloat16")
    per_block = 2 * 4 * d * d + 4 * d + d
    assert [c.params for c in amp.layers] == [per_block, per_block]
    assert [c.static_bytes for c in amp.layers] == [16 * per_block] * 2
    half = copy.deepcopy(model).to(torch.bfloat16)
    xh = x.to(torch.bfloat16)
    seq_h = autopipe.flatten(half, (xh,))
    pure = autopipe.profile(seq_h, (xh,), repeats=1, warmup=0, progress=False)
    weights = 2 * (2 * 4 * d * d)  # bf16 copies of both weight matrices; biases are not kept
    # the second block gets a bf16 input in both runs, so they differ by exactly its weight copies
    assert amp.layers[1].activation_bytes == pure.layers[1].activation_bytes + weights
    est = autopipe.profile(autopipe.flatten(half.to("meta"), (xh.to("meta"),)), (xh.to("meta"),), estimate=True,
                           autocast="bfloat16", progress=False)
    assert est.layers[1].activation_bytes == amp.layers[1].activation_bytes
    assert [c.static_bytes for c in est.layers] == [16 * per_block] * 2


def test_autocast_needs_fp32_layers_when_measuring() -> None:
    """Measuring under autocast a model already in bf16 would not be what train.py runs: refused."""
    half = _Block(8).to(torch.bfloat16)
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    with pytest.raises(AutopipeError, match="autocast trains fp32 parameters but the layers are bfloat16"):
        autopipe.profile(autopipe.flatten(half, (x,)), (x,), autocast="bf16", repeats=1, progress=False)


def test_timing_repeats_until_the_spread_is_small(monkeypatch: pytest.MonkeyPatch) -> None:
    """A noisy start (every other run 10x slower) makes time_layer take more samples until the
    interquartile range is within 10% of the median; the median is the quiet figure."""
    from autopipe.costs import measure

    # (forward, backward) per run: the forwards read 10, 1, 10, then 1 from there on
    readings = iter([10.0, 1.0, 1.0, 1.0, 10.0, 1.0] + [1.0] * 1000)

    def fake_clock(self, fn):  # noqa: ANN001, ANN202
        return next(readings), fn()

    monkeypatch.setattr(measure._Clock, "__call__", fake_clock)
    layer = nn.Linear(4, 4)
    t = measure.time_layer(layer, torch.randn(2, 4), device=torch.device("cpu"), warmup=0, repeats=3)
    assert t.samples > 3 and t.forward == 1.0 and t.forward_spread <= 0.1
    quiet = measure.time_layer(layer, torch.randn(2, 4), device=torch.device("cpu"), warmup=0, repeats=3)
    assert quiet.samples == 3  # settled at once: no extra runs


def test_identical_layers_that_disagree_are_named_and_take_the_faster_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last of a kind of identical layers is timed again; 10x apart, the profile warns, naming both,
    and every layer of that kind takes the faster (less disturbed) figure."""
    import autopipe.costs.profiler as prof_mod
    from autopipe.costs.measure import Timing

    x = torch.randn(B, 32)
    seq = _flatten(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), x)
    last = seq.layers[-1]

    def fake_time(layer, x, **kwargs):  # noqa: ANN001, ANN003, ANN202
        fast = layer is last and kwargs.get("mode", "none") == "none"
        return Timing(0.001, 0.002, 0.0, 0.0, 3) if fast else Timing(0.010, 0.020, 0.0, 0.0, 3)

    monkeypatch.setattr(prof_mod, "time_layer", fake_time)
    prof = autopipe.profile(seq, (x,), warmup=0, repeats=3, progress=False)
    twins = [w for w in prof.warnings if "identical layers" in w]
    assert len(twins) == 1  # (the whole model, timed for real, disagrees with these fake figures too)
    assert "identical layers 1 and 3 measured 3 and 30 ms per micro-batch (10.0x apart)" in twins[0]
    assert [round(c.forward_time + c.backward_time, 6) for c in prof.layers[1:]] == [0.003] * 3


def test_timings_that_stay_noisy_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the spread never settles, the profile says which layers and how noisy, instead of staying silent."""
    from autopipe.costs import measure

    readings = iter([10.0, 1.0, 1.0] * 10_000)  # a cycle of 3: forwards and backwards both jump
    monkeypatch.setattr(measure._Clock, "__call__", lambda self, fn: (next(readings), fn()))
    x = torch.randn(B, 8)
    prof = autopipe.profile(_flatten(nn.Sequential(nn.Linear(8, 8)), x), (x,), warmup=0, repeats=3, progress=False)
    assert any("stayed noisy" in w for w in prof.warnings)


def test_zero_bubble_split_is_timed_as_torch_runs_it_and_zbv_plans_use_it() -> None:
    """Each layer's backward is also timed as zero-bubble schedules split it (torch's own
    stage_backward_input, then stage_backward_weight); .grad is left alone; the profile's measured
    W share replaces the 0.5 guess and zbv's backward is the layer's in-model backward times the two
    passes' sum over the whole, at least 1, except in the first stage, which torch runs whole (a plan
    on zbv equals the simulator run on those figures)."""
    from autopipe.planner.schedules import simulate

    torch.manual_seed(0)
    blocks = nn.Sequential(*[_Block(64) for _ in range(4)])
    x = torch.randn(32, 64, requires_grad=True)
    seq = _flatten(blocks, x)
    prof = autopipe.profile(seq, (x,), repeats=3, warmup=1, progress=False)
    assert all(p.grad is None for p in blocks.parameters())
    for layer in prof.layers:
        assert layer.backward_input_time > 0 and layer.backward_weight_time > 0, layer
    share, cost = prof.split_backward
    assert 0 < share < 1 and cost > 0
    plan = autopipe.partition(prof, 2, microbatches=4, schedule="zbv", bandwidth=None, memory_limit=None)
    assert plan.weight_share == share
    bounds = plan.boundaries
    fwd = [sum(l.forward_time + l.forward_gap for l in prof.layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    two = [max(1.0, (l.backward_input_time + l.backward_weight_time) / l.backward_time) for l in prof.layers]
    bwd = [sum((l.backward_time + l.backward_gap) * (two[i] if a > 0 else 1.0)
               for i, l in enumerate(prof.layers[a:b], start=a)) for a, b in zip(bounds, bounds[1:])]
    sim = simulate("zbv", forward=fwd, backward=bwd, comm=[0.0] * len(fwd), ranks=2, microbatches=4, weight_share=share)
    assert plan.step_time == pytest.approx(sim.step_time, rel=1e-9)
    # a profile without the split (estimated, given, older) keeps the 0.5 guess
    assert Profile.from_costs([1, 2, 3, 4]).split_backward is None
    assert autopipe.partition(Profile.from_costs([1, 2, 3, 4]), 2, schedule="zbv", bandwidth=None).weight_share == 0.5


class _CountCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts casts of a weight-shaped tensor to bfloat16 (what autocast does to a Linear's weight)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.casts = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) == self.shape \
                and kwargs.get("dtype") == torch.bfloat16:  # fmt: skip
            self.casts += 1
        return func(*args, **kwargs)


def test_each_timed_run_casts_the_weights_again_under_autocast() -> None:
    """A job enters autocast afresh per micro-batch, so each forward casts its weights again; the
    profiler's timed runs share one autocast context, whose cache would time the cast only once
    (a bf16 GPT-2 job's forwards read 1.22-1.40x the profile that way). Every timed run, and every
    whole-model run, casts anew."""
    from autopipe.costs import measure
    from autopipe.costs.in_model import time_in_model

    layer = nn.Linear(48, 40)
    x = torch.randn(2, 48, requires_grad=True)
    cpu = torch.device("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16), _CountCasts((40, 48)) as count:
        measure.time_layer(layer, x, device=cpu, warmup=1, repeats=3, target_spread=None)
    assert count.casts == 4
    with torch.autocast("cpu", dtype=torch.bfloat16), _CountCasts((40, 48)) as count:
        measure.recompute_extras(layer, x, ["full"], device=cpu, warmup=0, repeats=2)
    # each round: a plain run (1 cast) and a full-recompute run (its forward, and again in its backward)
    assert count.casts == 2 * 3
    with torch.autocast("cpu", dtype=torch.bfloat16), _CountCasts((40, 48)) as count:
        time_in_model([layer, nn.Linear(40, 40)], x, device=cpu, warmup=0, repeats=3)
    assert count.casts >= 3  # one per whole-model run (a noisy machine adds runs)


def test_recompute_extra_is_the_median_of_paired_differences(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recomputation's extra backward is timed beside a plain backward in each round: a slow spell
    that falls on one round's recompute run moves nothing, where the difference of two separate
    medians (15 vs 35 here) would read it as 20 of extra."""
    from autopipe.costs import measure

    plain = iter([10.0, 30.0, 30.0, 10.0, 10.0])
    full = iter([15.0, 35.0, 35.0, 15.0, 35.0])
    calls = iter(range(10**6))

    def fake_clock(self, fn):  # noqa: ANN001, ANN202
        k = next(calls)  # per round: plain forward, plain backward, full forward, full backward
        value = 1.0 if k % 2 == 0 else (next(plain) if k % 4 == 1 else next(full))
        return value, fn()

    monkeypatch.setattr(measure._Clock, "__call__", fake_clock)
    layer = nn.Linear(4, 4)
    extra = measure.recompute_extras(layer, torch.randn(2, 4, requires_grad=True), ["full"],
                                     device=torch.device("cpu"), warmup=0, repeats=5)  # fmt: skip
    assert extra == {"full": 5.0}


def test_tp_shapes_are_traced_unless_asked_not_to_and_then_tp_is_refused() -> None:
    """convert without --tp profiles with tp_shapes=False (a third of a small profile saved); such a
    profile prices tp 1 the same and refuses tp 2 in one line rather than pricing it replicated."""
    from autopipe.costs.tp import at_tp
    from autopipe.errors import PartitionError

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16)) for _ in range(2)))
    x = torch.randn(B, 16)
    seq = autopipe.flatten(model, (x,))
    with_shapes = autopipe.profile(seq, (x,), repeats=1, warmup=0, progress=False)
    without = autopipe.profile(seq, (x,), repeats=1, warmup=0, progress=False, tp_shapes=False)
    assert any(layer.tp is not None and layer.tp.pairs for layer in with_shapes.layers)
    assert all(layer.tp is None for layer in without.layers)
    assert at_tp(without, 1, bandwidth=1e9) is without
    with pytest.raises(PartitionError, match="records no tensor-parallel shapes"):
        at_tp(without, 2, bandwidth=1e9)


_THREADS_SEEN: list[int] = []


@torch.library.custom_op("autopipe_test::threads_seen", mutates_args=())
def _threads_seen(x: Tensor) -> Tensor:
    _THREADS_SEEN.append(torch.get_num_threads())  # a custom op runs at profile time, not only when traced
    return x.clone()


@_threads_seen.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


_threads_seen.register_autograd(lambda ctx, grad: grad)


class _ThreadsSeen(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return _threads_seen(x)


@pytest.mark.parametrize("omp", [None, "2"])
def test_a_cpu_profile_times_its_layers_at_the_threads_a_rank_runs_with(monkeypatch: pytest.MonkeyPatch, omp: str | None) -> None:
    """A CPU job's ranks run OMP_NUM_THREADS threads each, 1 where it is unset (autopipe run, torchrun):
    the profile times at that count whatever the profiling process uses, records it, and gives the
    process its own count back. (It timed at torch's count: 2 threads on a 2-core machine, where two
    profiles of one model priced its step 19 % apart, bench/results/moe-ep-step.md.)"""
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    model = nn.Sequential(nn.Linear(8, 8), _ThreadsSeen(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    seq = _flatten(model, x)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        _THREADS_SEEN.clear()
        prof = autopipe.profile(seq, (x,), repeats=3, warmup=1, progress=False)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    want = 1 if omp is None else 2
    assert _THREADS_SEEN and set(_THREADS_SEEN) == {want}
    assert prof.device.threads == want
    explicit = autopipe.profile(seq, (x,), repeats=3, warmup=1, progress=False, threads=2)
    assert explicit.device.threads == 2
