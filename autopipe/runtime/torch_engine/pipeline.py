"""Run this rank's chunks under a torch.distributed.pipelining schedule.

Inputs: the first chunk takes the model's inputs packed into one flat tuple of tensors
(``LayerSequence.pack_inputs``), so integer ids and boolean masks cross cuts like any activation;
PipelineStage gives them no gradient (they do not require grad). The last chunk returns the
model's flat outputs; the loss function rebuilds the model's own output (``unpack_outputs``) and takes
its ``.loss`` (a HuggingFace model given ``labels``) or applies a user loss to it and the target.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ...errors import AutopipeError
from ...graph.recompute import shared_recompute
from ...planner.memory import splits_backward
from ...planner.stage_plan import StagePlan
from ..data.losses import model_loss
from ..process.comm import Comm
from ..stage.build import MicrobatchSeeds, PipeChunk, StageBuild
from ..stage.eval_mode import traced_eval_mode

__all__ = ["PipelineEngine", "Stopwatch"]


def receives_integers() -> bool:
    """Whether torch's PipelineStage can receive a tensor that is not floating point (token ids,
    labels, a boolean mask crossing a cut): torch >= 2.13 leaves such tensors without grad; 2.6-2.12
    make every received buffer require grad, which an integer tensor refuses, before the first step."""
    # the release numbers alone: NVIDIA's 2.13.0a0+git... builds and nightlies have the change too
    found = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return found is not None and (int(found.group(1)), int(found.group(2))) >= (2, 13)


def check_cuts_for_this_torch(seq: Any, plan: StagePlan) -> None:
    """Refuse, in one line and before any rank talks, a pipeline this torch cannot run (see
    :func:`receives_integers`); a rank failing inside torch's stage setup left its peers waiting."""
    if plan.pp_size == 1 or receives_integers():
        return
    for chunk in range(1, plan.num_chunks):
        first = plan.boundaries[chunk]
        for sig in seq.infos[first].inputs:
            dtype = getattr(torch, sig.dtype, None)
            if isinstance(dtype, torch.dtype) and not (dtype.is_floating_point or dtype.is_complex):
                raise AutopipeError(
                    f"torch {torch.__version__}'s pipeline stages make every tensor they receive require grad, "
                    f"and {sig.name} ({sig.dtype}) crosses the cut before layer {first} ({seq.infos[first].name}); "
                    "train on torch >= 2.13, on DeepSpeed (--engine deepspeed), or in one process (python train.py)."
                )


def _stage_class() -> type:
    """PipelineStage whose shape-inference pass feeds zeros, not uninitialised memory.

    On the first step each stage runs once on placeholders built from the previous stage's
    metadata. torch leaves them uninitialised; integer ones that crossed a cut (token ids, labels)
    then hold garbage indices and an embedding or cross-entropy fails out of bounds. Zeros are
    valid ids and harmless activations.
    """
    from torch.distributed.pipelining import PipelineStage

    class ZeroInitStage(PipelineStage):
        def _to_tensor(self, arg: Any) -> torch.Tensor:
            t = super()._to_tensor(arg)
            if not isinstance(arg, torch.Tensor):
                with torch.no_grad():
                    t.zero_()
            return t

        def _forward_metadata_inference(self, *args: Any, **kwargs: Any) -> Any:
            # the shape-inference forward on placeholders is not a micro-batch: it must not advance
            # the chunk's micro-batch count, which picks each layer's RNG seed
            with _placeholder_pass(self.submod):
                return super()._forward_metadata_inference(*args, **kwargs)

        def _shape_inference(self, *args: Any, **kwargs: Any) -> Any:  # the same pass in torch < 2.12
            with _placeholder_pass(self.submod):
                return super()._shape_inference(*args, **kwargs)

        # torch's action runtime runs a V schedule's backward actions in eval() too: each returns at
        # once for want of a backward, but the hand-over of input gradients between a rank's two
        # adjacent chunks asserts there is one. Evaluating under zbv: nothing to hand over.
        def get_local_bwd_output(self, mb_index: int) -> Any:
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
            if backward_type == "input" and _an_output_bypasses_the_inputs(bwd_kwargs["stage_output"],
                                                                          bwd_kwargs["input_values"]):
                # torch's split backward finds a weight's gradient only through the stage's inputs: one
                # sent on that never met them (T5's relative-position bias, computed from positions)
                # would get none. Such a chunk runs its full backward here; its weight pass is empty.
                grads, _ = super().backward_maybe_with_nosync("full", bwd_kwargs, last_backward=last_backward)
                return grads, []
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> Any:
            # A zero-bubble weight pass makes one autograd call per weight group; under recompute
            # each call would run the layer's forward again (measured ~6x the extra time on a GPT-2
            # block). One shared recomputation for the whole pass brings it to 2x (input pass + this).
            with shared_recompute():
                return super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)

    return ZeroInitStage


def _an_output_bypasses_the_inputs(outputs: Any, inputs: Any) -> bool:
    """Whether some stage output needing a gradient does not depend on any stage input."""
    def node(t: torch.Tensor) -> Any:
        return t.grad_fn if t.grad_fn is not None else t.view_as(t).grad_fn.next_functions[0][0]

    outs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    ins = {node(t) for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad}
    for out in outs:
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            continue
        seen, todo, met = set(), [node(out)], False
        while todo and not met:
            n = todo.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            met = n in ins
            todo.extend(fn for fn, _ in n.next_functions)
        if not met:
            return True
    return False


@contextlib.contextmanager
def _placeholder_pass(submod: nn.Module) -> Iterator[None]:
    """The stage's shape-inference forward: the chunk marks it (no micro-batch count, no seeds), and
    a DistributedDataParallel around the chunk runs it under ``no_sync``; outside it, DDP's forward
    (grad enabled) arms the reducer, and the first micro-batch's backward then all-reduced and
    recorded a bucket order twice the parameter count (torch's internal assert at step 2)."""
    chunk = getattr(submod, "module", submod)  # inside DistributedDataParallel or not
    chunk.shape_inference = True
    try:
        with submod.no_sync() if hasattr(submod, "no_sync") else contextlib.nullcontext():
            yield
    finally:
        chunk.shape_inference = False



class PipelineEngine:
    """This rank's PipelineStages and the schedule that runs them.

    With one pipeline rank every layer forms one chunk: the same schedule code, the same
    micro-batches and the same losses, in one process.
    """

    def __init__(
        self,
        build: StageBuild,
        *,
        pp_group: Any,
        device: torch.device,
        microbatches: int,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        autocast_dtype: torch.dtype | None = None,
        loss_scale: Callable[[], float] = lambda: 1.0,
        comm: Comm | None = None,
        wrap: Callable[[list[PipeChunk], str], Sequence[nn.Module]] | None = None,
    ) -> None:
        """``wrap`` receives the chunks the stages will run and the schedule's name, before any
        stage exists, and returns the modules the stages run: data parallelism wraps them there
        (``autopipe.runtime.torch_engine.zero.shard_chunks_``)."""
        from torch.distributed.pipelining.schedules import get_schedule_class

        check_cuts_for_this_torch(build.seq, build.plan)
        PipelineStage = _stage_class()

        self.build = build
        self.device = torch.device(device)
        self.comm = comm or Comm(self.device)
        self.microbatches = microbatches
        plan = build.plan
        chunks = build.chunks
        if plan.pp_size == 1 and len(chunks) > 1:
            layers = [layer for c in chunks for layer in c.layers]
            chunks = [PipeChunk(layers, 0, (0, plan.num_layers))]
        num_stages = 1 if plan.pp_size == 1 else plan.num_chunks
        self.chunks = chunks
        self._clock = Stopwatch(self.device)
        for chunk in chunks:
            chunk.autocast_dtype = autocast_dtype
            # a split backward detaches stage outputs in place, which torch refuses for views
            chunk.unview_outputs = splits_backward(plan.schedule)
            chunk.register_forward_pre_hook(self._tic)
            chunk.register_forward_hook(self._toc)
        name = plan.schedule if (plan.pp_size > 1 or not plan.multi) else "GPipe"
        modules: Sequence[nn.Module] = chunks if wrap is None else wrap(chunks, name)
        self.stages = [
            PipelineStage(m, c.index if num_stages > 1 else 0, num_stages, device, group=pp_group)
            for m, c in zip(modules, chunks)
        ]
        self.is_first = any(s.is_first for s in self.stages)
        self.is_last = any(s.is_last for s in self.stages)
        self._user_loss = loss_fn
        self._loss_scale = loss_scale
        self._metrics: list[torch.Tensor] | None = None  # evaluation: each micro-batch's figures
        cls = get_schedule_class(name)
        if plan.pp_size > 1 and plan.multi:
            self.schedule = cls(self.stages, microbatches, loss_fn=self._loss, scale_grads=True)
        else:
            self.schedule = cls(self.stages[0], microbatches, loss_fn=self._loss, scale_grads=True)

    def _tic(self, module: nn.Module, args: Any) -> None:
        # what the stage receives (inputs, or activations from the previous rank) is on our device
        self.comm.check(f"input of pipeline chunk {module.index}", args)
        self._clock.start()

    def _toc(self, module: nn.Module, args: Any, output: Any) -> None:
        self._clock.stop()

    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        outputs = self.build.seq.unpack_outputs(output)
        loss = model_loss(outputs) if self._user_loss is None else self._user_loss(outputs, target)
        if self._metrics is not None:  # evaluating: the figures, unscaled (there is no backward)
            self._metrics.append(self._figures(outputs, loss, target if self._classify else None))
            return loss
        return loss * self._loss_scale()

    @torch.no_grad()
    def evaluate(self, inputs: tuple[torch.Tensor, ...] | None, target: torch.Tensor | None, *,
                 figures: Callable[[Any, torch.Tensor, Any], torch.Tensor], classify: bool = False) -> torch.Tensor:
        """Forward only, every micro-batch, the model in eval mode (dropout off): on the rank of the
        last chunk the sum of ``figures(outputs, loss, labels)`` over the micro-batches
        (``autopipe.runtime.training.evaluate.eval_figures``: loss, micro-batches, correct rows, labelled
        rows), zeros elsewhere, as a float64 device tensor. ``target`` is the loss's target, or with
        ``classify`` each row's class id (the accuracy's reference; a user loss gets it as its target)."""
        if not hasattr(self.schedule, "eval"):
            from ...errors import AutopipeError

            raise AutopipeError("--eval-data needs torch's pipeline schedules with eval() (torch >= 2.7); upgrade torch.")
        for chunk in self.chunks:
            chunk.start_step(None)
        args = tuple(inputs) if (self.is_first and inputs is not None) else ()
        tgt = target if self.is_last else None
        if self.is_last and tgt is None:
            tgt = torch.zeros(self.microbatches, device=self.device)
        modules = [stage.submod for stage in self.stages]
        self._metrics, self._classify, self._figures = [], classify, figures
        try:
            # the traced layers' dropout and batch-norm flags, which .eval() alone leaves on
            with traced_eval_mode(modules):
                self.schedule.eval(*args, target=tgt, losses=[], return_outputs=False)
            figures = self._metrics
        finally:
            self._metrics = None
            _reshard(modules)
        if not figures:
            return torch.zeros(4, dtype=torch.float64, device=self.device)
        return torch.stack(figures).sum(0)

    def run(
        self, inputs: tuple[torch.Tensor, ...] | None, target: torch.Tensor | None, seeds: MicrobatchSeeds | None = None
    ) -> torch.Tensor | None:
        """One forward/backward of all micro-batches; gradients accumulate (mean over micro-batches).

        ``seeds`` seeds the RNG before each layer of each micro-batch (dropout then matches the
        unpipelined run's); None leaves the RNG alone.

        ``inputs`` (from ``pack_batch``, on this rank's device) matter on the rank of the first
        chunk, ``target`` on the rank of the last; other ranks may pass None. Returns the mean
        micro-batch loss (unscaled, a 0-dim float32 tensor on the device: reading it waits for the
        GPU, so the trainer reads it once, with the step's other figures) on the rank of the last
        chunk, None elsewhere. ``forward_time`` is then ready to read as well (see ``Stopwatch``).
        """
        self._clock.reset()
        for chunk in self.chunks:
            chunk.start_step(seeds)
        args = tuple(inputs) if (self.is_first and inputs is not None) else ()
        tgt = target if self.is_last else None
        if self.is_last and tgt is None:
            # the schedule wants a target on the last stage even when the model computes its loss
            tgt = torch.zeros(self.microbatches, device=self.device)
        self.comm.check("pipeline inputs", args)
        self.comm.check("pipeline target", tgt)
        losses: list[torch.Tensor] = []
        scale = self._loss_scale()
        self.schedule.step(*args, target=tgt, losses=losses, return_outputs=False)
        if not self.is_last:
            return None
        return torch.stack([l.detach().float() for l in losses]).mean() / scale

    @property
    def forward_time(self) -> float:
        """Seconds this rank spent in its chunks' forwards during the last ``run`` (read after the
        step's one device synchronisation: on a GPU it reads CUDA events)."""
        return self._clock.total()


def _reshard(modules: Sequence[nn.Module]) -> None:
    """Free the whole weights FSDP2 gathered for an evaluation's forwards (ZeRO 2 keeps them after
    a forward, for the backward that evaluation never runs): the next step gathers the updated ones."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2: nothing gathered
        return
    for m in modules:
        for mod in m.modules():
            if isinstance(mod, FSDPModule):
                mod.reshard()


class Stopwatch:
    """Time summed over start/stop pairs: CUDA events on a GPU (kernels run asynchronously, so the
    host clock would time the launches), the host clock on a CPU. ``total()`` on a GPU must come
    after the device is synchronised, which the trainer does once per step."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self) -> None:
        self._host = 0.0
        self._t0 = 0.0
        self._events: list[tuple[Any, Any]] = []

    def start(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events.append((ev, None))
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._events[-1] = (self._events[-1][0], ev)
        else:
            self._host += time.perf_counter() - self._t0

    def total(self) -> float:
        if self.cuda:
            return sum(a.elapsed_time(b) for a, b in self._events if b is not None) / 1000.0
        return self._host
