"""Where a pipeline step goes: ``torch.profiler`` ranges put around what each engine runs.

``install()`` wraps, in this process, the library functions both engines and the bare scripts call,
each in a ``record_function`` range named for its part of a step:

- ``forward`` / ``backward``: torch's ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``
  (and ``backward_weight_one_chunk``); DeepSpeed's forward and backward pass instructions;
- ``p2p``: posting and waiting for the schedule's sends and receives (torch's ``_batch_p2p`` and
  ``_wait_batch_p2p``; DeepSpeed's send/receive instructions): the wait for the neighbour is here;
- ``optimizer``: every ``Optimizer.step`` (torch's own range, found by name) and ``zero_grad``;
- ``grad norm/clip``: autopipe's ``global_grad_norm`` and ``clip_grads_``, torch's
  ``get_total_norm`` and ``clip_grads_with_norm_`` (the bare torch script), DeepSpeed's own clip;
- ``tied + dp reduce``: the tied tensors' gradient sums (autopipe's ``sync_tied_grads``, the bare
  script's all-reduce, DeepSpeed's tied and data-parallel reduce instructions);
- ``data``: the micro-batches' loading and packing (autopipe's ``pack_batch``, DeepSpeed's load
  instruction);
- ``stats + memory``: autopipe's one host read of the step's figures and its peak-memory reset.

``breakdown(prof, steps)`` turns a profile into seconds per step for each part, each range's own
time (less the labelled ranges inside it, so the clip inside an optimizer step counts once).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from torch.profiler import record_function

__all__ = ["PARTS", "breakdown", "install"]

PARTS = ["forward", "backward", "p2p", "optimizer", "grad norm/clip", "tied + dp reduce", "data", "stats + memory"]
_TAG = "part: "


def _labelled(fn: Any, part: str) -> Any:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with record_function(_TAG + part):
            return fn(*args, **kwargs)

    run._labelled = True  # type: ignore[attr-defined]
    return run


def _wrap(module: str, name: str, part: str) -> None:
    """Label ``module.name`` (an attribute: a function, or ``Class.method``), if it exists here."""
    try:
        owner = importlib.import_module(module)
    except ImportError:
        return
    *path, attr = name.split(".")
    for p in path:
        owner = getattr(owner, p, None)
        if owner is None:
            return
    fn = getattr(owner, attr, None)
    if fn is not None and not getattr(fn, "_labelled", False):
        setattr(owner, attr, _labelled(fn, part))


def install() -> None:
    """Put the ranges in: torch's pipelining and optimizers, autopipe's trainer, DeepSpeed's engine."""
    import torch

    st, sc = "torch.distributed.pipelining.stage", "torch.distributed.pipelining.schedules"
    _wrap(st, "_PipelineStageBase.forward_one_chunk", "forward")
    _wrap(st, "_PipelineStageBase.backward_one_chunk", "backward")
    _wrap(st, "_PipelineStageBase.backward_weight_one_chunk", "backward")
    _wrap(sc, "_batch_p2p", "p2p")
    _wrap(sc, "_wait_batch_p2p", "p2p")
    _wrap("torch.optim.optimizer", "Optimizer.zero_grad", "optimizer")
    torch.nn.utils.get_total_norm = _labelled(torch.nn.utils.get_total_norm, "grad norm/clip")
    torch.nn.utils.clip_grads_with_norm_ = _labelled(torch.nn.utils.clip_grads_with_norm_, "grad norm/clip")
    for name in ("global_grad_norm", "clip_grads_"):
        _wrap("autopipe.runtime.training.grads", name, "grad norm/clip")  # DeepSpeed's job imports them at its first step
        _wrap("autopipe.runtime.torch_engine.trainer", name, "grad norm/clip")
    _wrap("autopipe.runtime.torch_engine.trainer", "sync_tied_grads", "tied + dp reduce")
    _wrap("autopipe.runtime.torch_engine.trainer", "pack_batch", "data")
    _wrap("autopipe.runtime.torch_engine.trainer", "Trainer._gather", "stats + memory")
    _wrap("autopipe.runtime.logs.peak", "PeakMemory.reset", "stats + memory")
    _wrap("deepspeed.runtime.engine", "DeepSpeedEngine.clip_fp32_gradients", "grad norm/clip")
    try:
        from deepspeed.runtime.pipe import engine as ds
        from deepspeed.runtime.pipe import schedule
    except ImportError:
        return
    parts = {schedule.ForwardPass: "forward", schedule.BackwardPass: "backward", schedule.SendActivation: "p2p",
             schedule.RecvActivation: "p2p", schedule.SendGrad: "p2p", schedule.RecvGrad: "p2p",
             schedule.OptimizerStep: "optimizer", schedule.ReduceGrads: "tied + dp reduce",
             schedule.ReduceTiedGrads: "tied + dp reduce", schedule.LoadMicroBatch: "data"}  # fmt: skip
    table = ds.PipelineEngine._INSTRUCTION_MAP  # the engine dispatches through it, not by attribute
    for kind, part in parts.items():
        if kind in table and not getattr(table[kind], "_labelled", False):
            table[kind] = _labelled(table[kind], part)


def breakdown(prof: Any, steps: int) -> dict[str, float]:
    """Seconds per step of each part: the labelled ranges' own times (their labelled descendants'
    taken out) and every ``Optimizer.step`` range outside a labelled one, summed, over ``steps``."""
    totals = dict.fromkeys(PARTS, 0.0)

    def part_of(ev: Any) -> str | None:
        if ev.name.startswith(_TAG):
            return ev.name[len(_TAG) :]
        if ev.name.startswith("Optimizer.step#"):
            return "optimizer"
        return None

    def inner(ev: Any) -> float:  # time of the labelled ranges nearest below ev
        t = 0.0
        for child in ev.cpu_children:
            t += child.cpu_time_total if part_of(child) else inner(child)
        return t

    for ev in prof.events():
        part = part_of(ev)
        if part is None:
            continue
        totals[part] += (ev.cpu_time_total - inner(ev)) / 1e6  # microseconds
    return {k: v / steps for k, v in totals.items()}
