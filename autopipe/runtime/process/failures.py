"""An unexpected error inside a job, as one line: which stage, which layer, which operation, and where
every rank's traceback went.

A bug (ours or torch's) or a model that fails in training used to reach the user as one raw
traceback per rank. ``describe`` walks the traceback for the pipeline chunk and the flattened layer
that were running, and the graph node of that layer (its ATen operation and the line of the model's
source it came from; the layers are traced without source lines, so the failing rank traces its model
again with them, once, to find that line: ``autopipe.runtime.stage.build.retrace_with_sources_``);
``write_traceback`` appends the rank's full traceback to one file all ranks of the run share on a
machine. ``autopipe.runtime.process.lifecycle.one_line_errors`` prints the line, from rank 0.

Example:
    >>> try:
    ...     torch.ones(2) @ torch.ones(3)
    ... except RuntimeError as e:
    ...     describe(e).startswith("RuntimeError: inconsistent tensor size")
    True
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import fx

__all__ = ["describe", "error_log_path", "write_traceback"]


def describe(exc: BaseException) -> str:
    """``stage 1, layer 4 'model.layers.1' (MixtralDecoderLayer), operation aten.histc (modeling_x.py:52
    `...`): NotImplementedError: ...`` — the parts that can be found."""
    chain = [exc]  # engines re-raise with their own words ("[Stage 1] failed to run forward") from the real one
    while (chain[-1].__cause__ or chain[-1].__context__) is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)  # type: ignore[arg-type]
    frames = [f for e in chain for f in traceback.walk_tb(e.__traceback__)]
    exc = chain[-1]
    chunk = layer = node = None
    indexed: Any = None  # the outermost graph that is one of the sequence's layers (its index is known)
    for frame, lineno in frames:
        owner = frame.f_locals.get("self")
        if owner is None:
            continue
        if type(owner).__name__ in ("PipeChunk", "DSLayer"):
            chunk = owner
        if isinstance(owner, fx.GraphModule) and hasattr(owner, "autopipe_attrs"):
            layer = owner
            if indexed is None and getattr(owner, "autopipe_layer", (None,))[0] is not None:
                indexed = owner
            node = _node_at(owner, frame.f_code.co_filename, lineno) or node
    parts = []
    if chunk is not None and hasattr(chunk, "layer_range"):
        parts.append(f"stage {chunk.index}")
    if layer is not None:
        index, name, kind = getattr(layer, "autopipe_layer", (None, type(layer).__name__, ""))
        parts.append(f"layer {index} '{name}'" + (f" ({kind})" if kind and kind != "glue" else "") if index is not None
                     else f"layer {name}")
    if node is not None:
        parts.append(f"operation {_op_name(node)}{_source(_stack_trace(node, indexed))}")
    head = ", ".join(parts)
    text = " ".join((str(exc).strip().splitlines() or [""])[0].split())
    if len(text) > 300:
        text = text[:297] + "..."
    what = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return f"{head}: {what}" if head else what


def _node_at(gm: fx.GraphModule, filename: str, lineno: int) -> fx.Node | None:
    """The graph node whose line of the layer's generated code raised (``name = torch.ops...``)."""
    lines = gm.code.splitlines()
    if not filename.startswith("<eval_with_key>") or not 0 < lineno <= len(lines):
        return None
    assigned = lines[lineno - 1].split("=", 1)[0].strip()
    return next((n for n in gm.graph.nodes if n.name == assigned), None)


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._schema.name.split('::')[-1]}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def _stack_trace(node: fx.Node, layer: Any) -> str:
    """The node's recorded stack, or that of the node of the same name and operation in the same layer
    of the model traced again with source lines (the layer's ``autopipe_retrace``, given by
    ``retrace_with_sources_``); "" when neither has one."""
    retrace = getattr(layer, "autopipe_retrace", None)
    if node.meta.get("stack_trace") or retrace is None:
        return node.meta.get("stack_trace") or ""
    try:
        again = retrace().layers[layer.autopipe_layer[0]]
        for graph in again.modules():
            if isinstance(graph, fx.GraphModule):
                for other in graph.graph.nodes:
                    if other.name == node.name and other.target == node.target:
                        return other.meta.get("stack_trace") or ""
    except Exception:  # noqa: S110 (the report of the real error must not fail on this)
        pass
    return ""


def _source(stack: str) -> str:
    """`` (file.py:line `code`)``: the line of the model's source (not torch's) a node was traced from,
    out of its recorded stack."""
    trace = stack.strip().splitlines()
    for i in range(len(trace) - 1, -1, -1):
        line = trace[i].strip()
        if line.startswith("File "):
            try:
                path, rest = line[len("File ") :].split(", line ", 1)
                lineno = rest.split(",", 1)[0]
            except ValueError:
                return ""
            path = path.strip().strip('"')
            if path.startswith(_TORCH_DIR):  # torch's own module code: the model's line is further up
                continue
            code = trace[i + 1].strip() if i + 1 < len(trace) else ""
            return f" ({os.path.basename(path)}:{lineno}" + (f" `{code}`" if code else "") + ")"
    return ""


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def error_log_path() -> Path:
    """One file per run, the same on every rank of a machine: in the working directory, named after
    torchrun's run id (or this process, without torchrun)."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or str(os.getpid())
    safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in run)
    return Path.cwd() / f"autopipe-error-{safe}.log"


def write_traceback(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> Path | None:
    """Append this rank's full traceback to :func:`error_log_path` (one write, so ranks do not
    interleave); returns the file, or None when it cannot be written."""
    path = error_log_path()
    rank = os.environ.get("RANK", "0")
    text = f"==== rank {rank} (pid {os.getpid()}) ====\n" + "".join(traceback.format_exception(kind, value, tb)) + "\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError:
        return None
    return path
