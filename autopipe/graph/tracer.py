"""Trace pass: nn.Module + example inputs -> torch.export ExportedProgram (non-strict).

torch.export in non-strict mode runs the forward as Python with fake tensors, so HuggingFace models
(whose ``**kwargs`` forwards break ``torch.fx.symbolic_trace``) and plain modules both trace, also on
the meta device. The graph is ATen-level training IR: in-place buffer updates (BatchNorm running
statistics) stay in the graph as in-place ops on the buffers, so replaying it updates the real buffers.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import InputMismatchError, TraceError
from .expert_loops import batched_expert_loops
from .opaque import opaque_functions

__all__ = ["trace", "trace_device", "trace_with_notes"]

_TORCH_DIR = os.path.dirname(torch.__file__)


def trace(
    model: nn.Module,
    example_args: tuple[Any, ...] | list[Any] | Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    device_type: str | None = None,
) -> torch.export.ExportedProgram:
    """Export ``model`` on the example inputs, in the mode (train/eval) the model is in.

    The graph is specialised to the example shapes, and to the device type the model runs on: its
    tensors', or for a model on meta ``device_type`` (see :func:`trace_device`). Errors name the
    module and source line that failed and say what to try.

    Example:
        >>> ep = trace(torch.nn.Linear(4, 2), (torch.randn(3, 4),))
        >>> [s.target for s in ep.graph_signature.input_specs if s.target]
        ['weight', 'bias']
    """
    # what torch.export gives, source lines included (flatten leaves them out: trace_with_notes)
    return trace_with_notes(model, example_args, example_kwargs, device_type=device_type, stack_traces=True)[0]


def trace_with_notes(
    model: nn.Module, example_args: Any, example_kwargs: dict[str, Any] | None = None, *, device_type: str | None = None,
    stack_traces: bool = False,
) -> tuple[torch.export.ExportedProgram, list[str], set[str]]:
    """:func:`trace`, plus caveats seen while tracing (custom autograd Functions), and the names of the
    custom autograd Functions traced forward-only (torch could not keep them opaque: autopipe/graph/opaque.py).

    A model on the meta device is traced as if it were on ``device_type`` (see :func:`trace_device`).
    ``stack_traces``: record each node's source line (``node.meta["stack_trace"]``), as torch does by
    default. Off: torch's symbolising of a Python stack per node was 16-30 % of the trace (flatten on
    meta: GPT-2 1.21 -> 1.01 s, Llama-7B 4.30 -> 3.03 s, Llama-70B 11.74 -> 9.71 s; medians,
    bench/results/trace-sources.md), and only a failing rank's one-line report reads it, which
    traces again with it then (:func:`autopipe.runtime.stage.build.retrace_with_sources_`). A torch without the switch
    (``torch.fx.config.do_not_emit_stack_traces``; torch 2.13 has it) records them either way.
    """
    args = as_args(example_args)
    kwargs = dict(example_kwargs or {})
    _check_signature(model, args, kwargs)
    log = Path(tempfile.gettempdir()) / f"autopipe-trace-{type(model).__name__}-{os.getpid()}.log"
    fake = trace_device(model, device_type)
    try:
        with (opaque_functions() as (kept, lost), batched_expert_loops(model) as batched, _torch_log_to(log),
              _as_device(model, fake) as to_fake, _recording_stack_traces(stack_traces)):
            ep = torch.export.export(model, to_fake(args), to_fake(kwargs), strict=False)
    except Exception as e:  # torch raises many kinds here; all become one readable TraceError
        where = f" torch's log of the failed trace (its FX graph): {log}." if log.is_file() else ""
        raise TraceError(_explain(model, e) + where) from e
    notes = [f"custom autograd.Function {name}: kept as one opaque call, so its own backward runs; a cut never "
             "falls inside it" for name in kept if name not in lost]
    notes += [f"custom autograd.Function {name}: torch could not keep it opaque, so the flattened model "
              "differentiates the forward's ops instead of its hand-written backward" for name in sorted(lost)]
    notes += [f"{name}: its loop over the routed experts traced as the same arithmetic batched "
              "(autopipe/graph/expert_loops.py)" for name in batched]
    return ep, notes, lost


@contextlib.contextmanager
def _recording_stack_traces(on: bool) -> Iterator[None]:
    import torch.fx.config as config

    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = not on
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def trace_device(model: nn.Module, device_type: str | None = None) -> str:
    """The device type ``model``'s forward runs as while it is traced.

    A model with real tensors runs where they are. A model on the meta device (no memory: every
    rank of a job traces one) runs on fake tensors of ``device_type`` (default: cuda when torch sees
    one, else cpu), so Python that branches on ``x.device.type`` (transformers' MoE experts kernels
    do) takes the branch of the device the job trains on. A device type this torch cannot fake
    (cuda on a CPU-only build: fake CUDA tensors abort the process there) falls back to cpu; the
    job then retraces on its own device (autopipe.runtime.build_stage).

    Example:
        >>> trace_device(torch.nn.Linear(2, 2, device="meta"), "cpu"), trace_device(torch.nn.Linear(2, 2))
        ('cpu', 'cpu')
    """
    tensors = [*model.parameters(), *model.buffers()]
    real = next((t for t in tensors if not t.is_meta), None)
    if real is not None:
        return real.device.type
    if not tensors and device_type is None:
        return "cpu"
    wanted = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if wanted in ("cpu", "meta"):
        return wanted
    backend = getattr(torch, wanted, None)
    available = getattr(backend, "is_available", None)
    return wanted if callable(available) and available() else "cpu"


@contextlib.contextmanager
def _as_device(model: nn.Module, device_type: str) -> Iterator[Any]:
    """While tracing a meta model for ``device_type``: its parameters and buffers are fake tensors
    of that device (the same fake for every name of one tensor, so ties stay ties), put back after.
    Yields the function that turns the example inputs into fakes of that device too."""
    tensors = [*model.parameters(), *model.buffers()]
    if device_type == "meta" or not tensors or not all(t.is_meta for t in tensors):
        yield lambda tree: tree
        return
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # what torch.export makes for itself, which it takes over when the inputs are fakes of a mode
    mode = FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[], prefer_deferred_runtime_asserts_over_guards=True,
                                             trace_asserts=True), allow_non_fake_inputs=True, export=True)
    device = torch.device(device_type)
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            made = FakeTensor(mode, t if t.is_meta else t.to("meta"), device)
            fakes[id(t)] = nn.Parameter(made, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else made
        return fakes[id(t)]

    slots = [(table, attr, t) for mod in model.modules() for table in (mod._parameters, mod._buffers)
             for attr, t in table.items() if t is not None]
    try:
        for table, attr, t in slots:
            table[attr] = fake(t)
        yield lambda tree: tree_map(lambda v: fake(v) if isinstance(v, torch.Tensor) else v, tree)
    finally:
        for table, attr, t in slots:
            table[attr] = t


@contextlib.contextmanager
def _torch_log_to(path: Path) -> Iterator[None]:
    """Keep what torch prints while exporting off the screen: on a failed guard it prints the partial
    FX graph to stderr and logs more (screens of it). If the export fails, that text goes to ``path``
    (the error names it); if it succeeds, it is printed as torch would have."""
    if os.environ.get("AUTOPIPE_DEBUG"):
        yield
        return
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setLevel(logging.WARNING)  # what torch shows by default
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    # torch._logging gives its loggers handlers of their own (torch, torch._dynamo, ...): swap them
    # all, except the structured trace log (torch.__trace), which is not for screens
    loggers = [logging.getLogger("torch")] + [
        lg for name, lg in logging.root.manager.loggerDict.items()
        if name.startswith("torch.") and not name.startswith("torch.__")
        and isinstance(lg, logging.Logger) and lg.handlers
    ]
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.handlers, lg.propagate = [handler], False
    failed = False
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    except BaseException:
        failed = True
        raise
    finally:
        for lg, handlers, propagate in saved:
            lg.handlers, lg.propagate = handlers, propagate
        text = buffer.getvalue()
        if text and failed:
            path.write_text(text)
        elif text:
            sys.stderr.write(text)


def as_args(example_args: Any) -> tuple[Any, ...]:
    if isinstance(example_args, tuple):
        return example_args
    if isinstance(example_args, list):
        return tuple(example_args)
    return (example_args,)


def _check_signature(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):  # builtins without a signature: let export decide
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        bare = sig.replace(
            parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )
        raise InputMismatchError(
            f"example inputs don't match {type(model).__name__}.forward{bare}: {e}. "
            "Pass example inputs the way you would call the model."
        ) from None


def _explain(model: nn.Module, exc: BaseException) -> str:
    """One paragraph: what failed, where (module + source line), and what to try."""
    made = _made_in_forward(model, exc)
    if made:
        return made
    reason = _first_line(exc)
    where = _user_frame(model, exc)
    hint = _hint(exc)
    if "layerdrop" in where.lower():
        # transformers < 5.24 (OPT, BART, ...) draws the skip even at layerdrop 0; later ones don't
        hint = ("That is LayerDrop, which skips layers at random: no fixed pipeline can run it. This transformers "
                "draws even with layerdrop 0; upgrade transformers (5.24 skips the draw there) and keep layerdrop 0.")
    return f"could not trace {type(model).__name__}: {reason}{where}. {hint}"


def _made_in_forward(model: nn.Module, exc: BaseException) -> str:
    """torch.export's "fake tensor in the exported program constant's list", said as its cause: a
    tensor the forward makes from Python values (``torch.tensor(0.0)`` in Gemma3n's attention), then
    computes with, which export lifts as a constant ``<module>.lifted_tensor_N`` it cannot keep."""
    text = str(exc)
    if "fake tensor in the exported program constant" not in text:
        return ""
    found = re.search(r"model attribute: ([\w.]*?)\.?lifted_tensor_\d+", text)
    path = found.group(1) if found else ""
    try:
        kind = f" ({type(model.get_submodule(path)).__name__})" if path else ""
    except AttributeError:
        kind = ""
    where = f"module '{path}'{kind}" if path else "the model"
    return (f"could not trace {type(model).__name__}: the forward of {where} makes a tensor from Python values "
            "(torch.tensor(...) inside forward) and computes with it, which torch.export cannot keep as a constant. "
            "Make it a buffer in __init__ (register_buffer(..., persistent=False)) or compute it with Python math; "
            "AUTOPIPE_DEBUG=1 shows the full traceback.")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), text)
    if len(line) > 200:
        line = line[:197] + "..."
    return f"{type(exc).__name__}: {line}"


def _user_frame(model: nn.Module, exc: BaseException) -> str:
    """Find the deepest frame outside torch that belongs to a module of ``model``."""
    names = {id(m): name for name, m in model.named_modules()}
    found = ""
    tb = exc.__traceback__
    for frame, lineno in traceback.walk_tb(tb):
        filename = frame.f_code.co_filename
        if filename.startswith(_TORCH_DIR):
            continue
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            code = linecache.getline(filename, lineno).strip()
            name = names[id(owner)] or "<root>"
            found = (
                f" in module '{name}' ({type(owner).__name__}.{frame.f_code.co_name}, "
                f"{os.path.basename(filename)}:{lineno}: `{code}`)"
            )
    return found


def _hint(exc: BaseException) -> str:
    text = f"{type(exc).__name__} {exc}".lower()
    if "data-dependent" in text or "datadependent" in text or "guard" in text:
        return (
            "The forward branches on tensor values; make the branch depend on shapes or flags, "
            "or move it out of forward. Set AUTOPIPE_DEBUG=1 for the full traceback."
        )
    if "unsupported" in text or "not supported" in text:
        return (
            "An operation in that line cannot be exported; rewrite it with torch ops "
            "or wrap the model so it is not called. Set AUTOPIPE_DEBUG=1 for the full traceback."
        )
    return "Check the example inputs and that forward runs eagerly; set AUTOPIPE_DEBUG=1 for the full traceback."
