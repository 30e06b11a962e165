"""Each layer timed inside the whole model: what the per-layer figures miss, measured and charged.

A layer timed alone runs its forward and, at once, its backward, again and again: its weights and
activations stay in cache, and its tensors find room in the heap. Inside a training step neither
holds: between a layer's forward and its backward every later layer runs, and the step's live set
is the whole model's. On this CPU the layers timed alone summed to 0.6-0.9 of the whole model's
forward+backward (bench/results/profile.md): in thread CPU time too (so not other processes'
load), more under the runtime's allocator settings (``devices.keep_freed_memory``: the whole
step's large tensors are mapped afresh and page-faulted in, 40,000-130,000 minor faults per
forward+backward of a 6 x 256 GPT-2, none for its layers alone).

So the profiler also runs the whole model on one micro-batch, as a step does, and marks where each
layer's forward ends (a clock reading between layers) and where each layer's backward ends (a hook
on the gradient of the tensor the layer was given, which autograd computes when the layer's
backward is done). Each layer's time in the model is the span between its marks (its least span
over the runs, scaled with every other layer's to the runs' lower quartile: ``time_in_model``); the
spans add up to the whole model's time. The difference from the layer's own figure is its gap
(``LayerCost.forward_gap``, ``backward_gap``, signed), which ``LayerCost.time`` and every plan's
stage times include.

Example:
    >>> from autopipe.costs.layer_costs import Profile
    >>> prof = Profile.from_costs([3.0, 3.0], forward_times=[1.0, 1.0])
    >>> inside = InModelTiming(forward=(1.0, 1.5), backward=(2.5, 2.0))
    >>> charged, note = charge_in_model(prof.layers, inside)
    >>> [(l.forward_gap, l.backward_gap) for l in charged], sum(l.time for l in charged)
    ([(0.0, 0.5), (0.5, 0.0)], 7.0)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..graph.recompute import run_layer
from ..graph.sequence import as_tuple
from .layer_costs import LayerCost
from .measure import MAX_REPEAT_FACTOR, TARGET_SPREAD, Value, grads_put_back, fresh_casts, grad_outputs, median_iqr

__all__ = ["InModelTiming", "charge_in_model", "time_in_model"]


@dataclass(frozen=True)
class InModelTiming:
    """Per layer, the seconds of its forward and its backward inside the whole model (each layer's
    least span over the runs, scaled to the runs' lower quartile: see ``time_in_model``)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    spread: float = 0.0  # interquartile range of the whole model's runs, scaled to ``total``

    @property
    def total(self) -> float:
        return sum(self.forward) + sum(self.backward)


class _Marks:
    """Points in time on the device's stream (CUDA events) or the host clock, read after a sync."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.points: list[Any] = []

    def mark(self) -> int:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())
        return len(self.points) - 1

    def seconds(self, a: int, b: int) -> float:
        if self.cuda:
            return self.points[a].elapsed_time(self.points[b]) / 1000.0
        return self.points[b] - self.points[a]

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def _fresh(value: Value, given: set[int]) -> list[Tensor]:
    """The tensors of a layer's output it made itself (not passed through) that want a gradient."""
    return [t for t in as_tuple(value) if isinstance(t, Tensor) and t.requires_grad and id(t) not in given]


def time_in_model(layers: Sequence[nn.Module], x: Value, *, device: torch.device, warmup: int,
                  repeats: int, on_run: Callable[[int], None] | None = None) -> InModelTiming:
    """Seconds of each layer's forward and backward inside the whole model on one micro-batch (the
    module docstring) over ``repeats`` runs after ``warmup``, and more runs (up to
    ``MAX_REPEAT_FACTOR`` times as many) while the whole model's interquartile range stays above
    ``TARGET_SPREAD`` of its median: each layer's least span, all scaled by one factor so that they
    add up to the lower quartile of the runs' totals.

    Why a low figure, where a layer alone takes the median: a whole-model run lasts seconds on a CPU,
    long enough for many runs to meet other work on a shared machine (two torch threads on two busy
    cores: 0.54, 1.19 and 6.68 s for the same GPT-2 step), and other work only ever adds time; a
    layer's runs last milliseconds, and most meet none. Why not the least: the machine has fast
    moments too, and the least over more runs catches more of them (a job's step is a median over
    its steps); the least spans give each layer's share, the quartile the whole.

    ``on_run`` is called with the count of runs done (warm-up included) after each: progress."""
    params = list(dict.fromkeys(p for layer in layers for p in layer.parameters() if p.requires_grad))
    targets = params + [t for t in as_tuple(x) if isinstance(t, Tensor) and t.requires_grad]
    n = len(layers)
    forwards: list[list[float]] = [[] for _ in range(n)]
    backwards: list[list[float]] = [[] for _ in range(n)]
    totals: list[float] = []
    # into .grad, adding to what is there: a job's micro-batches after its first add theirs (0.5 ns
    # per parameter on a GPT-2 on this CPU, 3 ms a micro-batch: no layer timed alone pays it)
    with grads_put_back(targets):
        for t in targets:
            t.grad = torch.zeros_like(t)
        for run in range(warmup + repeats * MAX_REPEAT_FACTOR):
            if run >= warmup + repeats and _settled(totals):
                break
            marks = _Marks(device)
            fresh_casts()  # one micro-batch's forward: its weights cast afresh, as in a job
            marks.sync()
            ends = [marks.mark()]
            boundary: list[list[Tensor]] = []  # per layer, the fresh tensors it was given
            y, before = x, set()
            for layer in layers:
                boundary.append(_fresh(y, before))
                before = {id(t) for t in as_tuple(y)}  # what the layer was given: passed through, not made
                y = run_layer(layer, y, "none")
                ends.append(marks.mark())
            outs, grads = grad_outputs(y)
            done: list[int | None] = [None] * n  # per layer: the mark when its input's gradient was ready
            handles = []
            for i, tensors in enumerate(boundary):
                for t in tensors:
                    def hook(grad: Tensor, i: int = i, done: list[int | None] = done, marks: _Marks = marks) -> None:
                        done[i] = marks.mark()  # the last of the layer's inputs to be ready wins

                    handles.append(t.register_hook(hook))
            start = marks.mark()
            if outs and targets:
                torch.autograd.backward(outs, grads, inputs=targets)
            end = marks.mark()
            for h in handles:
                h.remove()
            marks.sync()
            y = outs = grads = None  # free this run's graph before the next forward
            if on_run is not None:
                on_run(run + 1)
            if run < warmup:
                continue
            # the backward runs from the last layer to the first: layer i's ends where its input's
            # gradient is ready (its predecessor's begins); a layer given nothing to differentiate ends
            # with its predecessor (an empty span)
            later = start
            for i in reversed(range(n)):
                mark = done[i] if done[i] is not None and i > 0 else (end if i == 0 else later)
                backwards[i].append(max(0.0, marks.seconds(later, mark)))
                forwards[i].append(marks.seconds(ends[i], ends[i + 1]))
                later = mark
            totals.append(marks.seconds(ends[0], ends[-1]) + marks.seconds(start, end))
    # Each layer's share from its least span; the whole from the runs' lower quartile. The least
    # spans summed are the machine's best moments and then some (a late clock reading shortens one
    # span and lengthens the next, and each layer keeps the shorter): 1.5-7% under the least whole
    # run on an 8-block GPT-2, and the least of 15 runs planned that GPT-2's job 8% under its
    # measured step (bench/results/accuracy.md, 2026-11-26 morning). A job's step is a median.
    least_f, least_b = [min(f) for f in forwards], [min(b) for b in backwards]
    least = sum(least_f) + sum(least_b)
    whole = statistics.quantiles(totals, n=4, method="inclusive")[0] if len(totals) > 1 else least
    scale = whole / least if least > 0 else 1.0
    return InModelTiming(forward=tuple(scale * f for f in least_f), backward=tuple(scale * b for b in least_b),
                         spread=median_iqr(totals)[1] / max(median_iqr(totals)[0], 1e-12) * whole)


def _settled(totals: list[float]) -> bool:
    median, spread = median_iqr(totals)
    return median <= 0 or spread <= TARGET_SPREAD * median


def charge_in_model(layers: Sequence[LayerCost], inside: InModelTiming,
                    tied: Mapping[int, float] | None = None) -> tuple[tuple[LayerCost, ...], str]:
    """The layers with their gaps (in the model less alone, signed) set, and a warning when the whole
    model's timings stayed noisy (a busy machine). How far the layers alone fall short of the whole
    model is no warning: it is expected (caches, and on a CPU page faults a layer alone does not meet),
    charged here, and kept in the profile (``forward_gap``, ``backward_gap``) and its report; printed
    on every CPU profile it was noise the user had not caused (issue 23). ``tied``: layer index -> seconds of a
    tied tensor's gradient sum that fell in its backward span (the pipeline all-reduces those
    instead; ``Profile.tied_grad_time`` keeps them apart)."""
    tied = dict(tied or {})
    charged = []
    for i, (l, f, b) in enumerate(zip(layers, inside.forward, inside.backward)):
        b = max(0.0, b - tied.get(i, 0.0))
        charged.append(replace(l, forward_gap=f - l.forward_time, backward_gap=b - l.backward_time))
    noisy = ""
    if inside.total > 0 and inside.spread > 2 * TARGET_SPREAD * inside.total:
        noisy = (f"the whole model's timings stayed noisy (interquartile range {inside.spread / inside.total:.0%} of "
                 "the median): the layers' in-model gaps may carry a busy machine's time; profile again on a quiet machine.")
    return tuple(charged), noisy
