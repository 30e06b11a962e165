"""Flatten pass: traced graph -> LayerSequence (the mechanism; autopipe/graph/cut_policy.py is the policy).

A layer is a GraphModule over its nodes that takes the tuple of every value live across its input
cut and returns the tuple live across its output cut. Parameters and buffers are the model's own
objects, registered at their original dotted names. Values the batch does not change (causal masks,
rotary tables) are not live across cuts: each layer reading one calls its shared holder
(autopipe/graph/batch_free.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import operator
from typing import Any, Literal

import torch
from torch import fx, nn
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from ..errors import TraceError, TraceMismatchError
from .attention import simplify_attention
from .batch_free import BatchFreeValue, batch_free_nodes, computed_in_layer, crossing_values, recipe
from .cut_policy import Segment, group_blocks, is_glue, module_stack, segment
from .expert_calls import EXPERTS_OP, experts_call_of
from .gradients import check_gradients
from .rng import RngState
from .sequence import (
    IOSpec,
    LayerInfo,
    LayerSequence,
    TensorSig,
    TiedGroup,
    as_tuple,
    retarget_device_,
)
from .tp_plan import hf_tp_plan
from .tracer import as_args, trace_device, trace_with_notes

__all__ = ["flatten", "Granularity"]

Granularity = Literal["block", "leaf"]


def flatten(
    model: nn.Module,
    example_args: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    granularity: Granularity = "block",
    blocks_per_layer: int = 1,
    validate: bool = True,
    name: str = "",
    device_type: str | None = None,
    autocast: torch.dtype | str | None = None,
    stack_traces: bool = False,
) -> LayerSequence:
    """Trace ``model`` and flatten it into a pipe-compatible LayerSequence.

    Args:
        model: any nn.Module, on a real device or on ``meta``. It is not modified.
        example_args: positional inputs of the micro-batch shape; the sequence is specialised to
            these shapes (as a pipeline engine's fixed micro-batch is).
        example_kwargs: keyword inputs, likewise.
        granularity: ``"block"`` cuts at repeated blocks (``h.N``, ``layers.N``); ``"leaf"`` at every
            module call that holds parameters.
        blocks_per_layer: coarser layers: this many consecutive blocks per layer.
        validate: with real weights, compare the sequence's outputs with the eager model's and raise
            TraceMismatchError on a difference (the graph may have dropped a branch).
        device_type: for a model on meta, the device type its Python branches are resolved for
            (``x.device.type == "cuda"``); default cuda when torch sees one, else cpu. A model with
            real tensors is traced where they are. ``seq.trace_device`` records it.
        autocast: the 16-bit dtype the layers will run under (``train.py --dtype bf16|fp16``);
            the model is traced under that autocast, so the regions it keeps in fp32 on purpose
            stay in the graph (below). None (fp32 training): traced without.
        stack_traces: keep each graph node's source line (``node.meta["stack_trace"]``); off, the
            trace takes 16-30 % less time (bench/results/trace-sources.md).

    Why trace under the training autocast: transformers' ``maybe_autocast(enabled=False)`` (GPT-2's
    upcast attention, Nemotron's norm, the rotary tables of some versions) enters its fp32 region
    only when autocast is on. Traced without autocast it left no region, and the layers then ran
    that matmul in bf16 under the job's autocast: a slightly different function from the user's
    model (GPT-2 with ``reorder_and_upcast_attn``: logits 4e-3 off on a 2-layer model; a Llama-1B
    bf16 job on an H200 with transformers 5.17: 1.48, ten times what bf16 moves the untouched
    model by itself). Ops outside such regions trace the same either way.

    Examples:
        >>> import torch, autopipe
        >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> seq = autopipe.flatten(m, (torch.randn(2, 8),))
        >>> [info.name for info in seq.infos]
        ['0', '1', '2']
    """
    if granularity not in ("block", "leaf"):
        raise TraceError(f"granularity must be 'block' or 'leaf', got {granularity!r}.")
    if blocks_per_layer < 1:
        raise TraceError(f"blocks_per_layer must be >= 1, got {blocks_per_layer}.")
    args = as_args(example_args)
    kwargs = dict(example_kwargs or {})
    traced_for = trace_device(model, device_type)
    amp = _training_autocast(traced_for, autocast)
    with amp:
        ep, notes, lost = trace_with_notes(model, args, kwargs, device_type=traced_for, stack_traces=stack_traces)
    # before cutting, on the whole graph: a gradient the trace lost is an error, never a note
    check_gradients(model, ep, args, kwargs, lost)
    seq = _flatten_program(model, ep, args, kwargs, granularity, blocks_per_layer, name)
    seq.notes.extend(notes)
    seq.trace_device = traced_for
    if _on_meta(model) and traced_for != "meta":
        # traced as another device, its layers hold meta tensors (until build_stage); constants made
        # in forward (torch.tensor(1)) keep the values the trace gave them
        retarget_device_(seq, "meta", constants=False)
    if validate and not _on_meta(model):
        _validate(model, seq, args, kwargs)
    return seq


def _training_autocast(device_type: str, dtype: torch.dtype | str | None) -> Any:
    """The autocast a job's layers run under, to trace in (``flatten``'s docstring says why)."""
    if dtype is None or device_type == "meta":
        return contextlib.nullcontext()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Mechanism: cutting the graph into layers


def _flatten_program(
    model: nn.Module,
    ep: torch.export.ExportedProgram,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    granularity: str,
    blocks_per_layer: int,
    name: str,
) -> LayerSequence:
    gm = ep.graph_module
    sig = ep.graph_signature
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_name = {n.name: n for n in placeholders}

    # What every non-user placeholder stands for: the model's own tensor, found by name, kept by identity.
    attr_of: dict[fx.Node, tuple[str, str, torch.Tensor]] = {}
    user_inputs: list[fx.Node] = []
    for spec in sig.input_specs:
        node = by_name[spec.arg.name]
        if spec.kind == InputKind.PARAMETER:
            attr_of[node] = (spec.target, "parameter", model.get_parameter(spec.target))
        elif spec.kind == InputKind.BUFFER:
            attr_of[node] = (spec.target, "buffer", model.get_buffer(spec.target))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            attr_of[node] = (f"_autopipe_const.{spec.target}", "constant", _unfake(ep.constants[spec.target]))
        elif spec.kind == InputKind.USER_INPUT:
            user_inputs.append(node)
        else:
            raise TraceError(f"unsupported graph input {spec.arg.name} of kind {spec.kind.name}.")
    for spec in sig.output_specs:
        if spec.kind not in (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION):
            raise TraceError(f"unsupported graph output {spec.arg} of kind {spec.kind.name}.")

    # User inputs: tensors are packed for layer 0; other leaves (use_cache=False) were baked in.
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    if len(leaves) != len(user_inputs):
        raise TraceError(f"export saw {len(user_inputs)} inputs but the example has {len(leaves)} leaves.")
    constant_of: dict[fx.Node, Any] = {}
    tensor_inputs: list[fx.Node] = []
    tensor_positions: list[int] = []
    for i, (node, leaf) in enumerate(zip(user_inputs, leaves)):
        if isinstance(leaf, torch.Tensor):
            tensor_inputs.append(node)
            tensor_positions.append(i)
        else:
            constant_of[node] = leaf

    # What batch-free values are made from (autopipe.graph.batch_free): lifted constants, buffers the
    # model never writes (one it writes depends on the steps before) and the inputs baked in.
    written = {spec.target for spec in sig.output_specs if spec.kind == OutputKind.BUFFER_MUTATION}
    sources = [n for n, (target, kind, _) in attr_of.items()
               if kind == "constant" or (kind == "buffer" and target not in written)]
    sources += list(constant_of)
    # SDPA as the eager model calls it (autopipe.graph.attention): no traced causal mask, no
    # repeated key/value heads. Before cutting: the mask's nodes go with it.
    attention = simplify_attention(gm, batch_free_nodes(gm, sources), {n: t for n, (_, _, t) in attr_of.items()},
                                   constant_of)

    params_set = {n for n, (_, kind, _) in attr_of.items() if kind == "parameter"}
    segments = group_blocks(segment(gm, params_set, granularity), blocks_per_layer)
    if not segments:
        raise TraceError(f"{type(model).__name__} traced to an empty graph: there is nothing to pipeline.")

    # Outputs: user outputs in order; buffer mutations (functional IR) are written back in place.
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    out_args = list(output_node.args[0])
    user_out: list[Any] = []
    mutations: list[tuple[fx.Node, str]] = []
    for spec, value in zip(sig.output_specs, out_args):
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutations.append((value, spec.target))
        else:
            user_out.append(value)

    layer_of: dict[fx.Node, int] = {}
    for i, seg in enumerate(segments):
        for n in seg.nodes:
            layer_of[n] = i
    num = len(segments)

    def is_tensor_value(node: fx.Node) -> bool:
        if node in constant_of:
            return False
        val = node.meta.get("val")
        return isinstance(val, torch.Tensor) or val is None and node.op == "placeholder"

    # Batch-free values a later layer reads are made on each stage that reads them, never sent
    # (autopipe.graph.batch_free): the rotary tables of a decoder, a mask that is not SDPA's causal one.
    read = [[n for n in seg.nodes if n.target not in _TRACE_ONLY] for seg in segments]
    outputs = [v for v in user_out if isinstance(v, fx.Node)]
    free, folded = crossing_values(gm, sources, read, layer_of, outputs, is_tensor_value)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    holders: dict[fx.Node, tuple[str, BatchFreeValue, list[fx.Node]]] = {}
    for v in sorted(folded, key=order.__getitem__):
        graph, reads = recipe(v, constant_of)
        holders[v] = (f"batch_free_{v.name}", BatchFreeValue(graph, v.name), reads)

    # Liveness: live[c] holds the values layer c takes; live[num] the final outputs.
    last_use: dict[fx.Node, int] = {}

    def use(value: fx.Node, at: int) -> None:
        if value in attr_of or value in constant_of or value.op == "get_attr" or not is_tensor_value(value):
            return
        if value in folded:  # made where it is read
            return
        last_use[value] = max(last_use.get(value, -1), at)

    for i, seg in enumerate(segments):
        for n in seg.nodes:
            for a in n.all_input_nodes:
                use(a, i)
    for value in user_out:
        if isinstance(value, fx.Node):
            use(value, num)
    for value, _ in mutations:
        use(value, layer_of.get(value, 0))
    live: list[list[fx.Node]] = [list(tensor_inputs)]
    for c in range(1, num + 1):
        vals = [v for v, last in last_use.items() if layer_of.get(v, -1) < c <= last]
        # Longest-lived first (labels, masks, then the hidden state): identical blocks then take
        # identical tuples, so their structure keys match and the profiler measures one of them.
        live.append(sorted(vals, key=lambda v: (-last_use[v], order[v])))
    final = [v for v in user_out if isinstance(v, fx.Node) and v not in constant_of]
    live[num] = final
    out_constants = tuple(
        (i, constant_of.get(v, v)) for i, v in enumerate(user_out) if not isinstance(v, fx.Node) or v in constant_of
    )

    names_of: dict[int, list[str]] = {}
    for target, kind, tensor in attr_of.values():
        if kind == "parameter":
            names_of.setdefault(id(tensor), []).append(target)
    layers: list[nn.Module] = []
    computed: list[list[fx.Node]] = []
    for i, seg in enumerate(segments):
        muts = [(v, t) for v, t in mutations if layer_of.get(v) == i]
        nodes = [n for n in seg.nodes if n.target not in _TRACE_ONLY]
        own = computed_in_layer(nodes, free, folded, [*live[i + 1], *(v for v, _ in muts)])
        skip = {n for n in nodes if n in free and n not in own}
        layer = _build_layer(seg, live[i], live[i + 1], attr_of, constant_of, muts, model, i, names_of, holders, skip)
        layers.append(layer)
        computed.append([v for v in holders if any(
            node.op == "call_module" and node.target == holders[v][0] for node in layer.graph.nodes)])

    tied, canonical_of = _find_tied(layers, attr_of)
    infos = [
        _layer_info(i, seg, layer, live[i], live[i + 1], canonical_of, computed[i])
        for i, (seg, layer) in enumerate(zip(segments, layers))
    ]
    for layer, info in zip(layers, infos):
        layer.autopipe_layer = (info.index, info.name, info.kind)  # what an error inside it names
    io = IOSpec(
        in_spec=in_spec,
        in_tensor_positions=tuple(tensor_positions),
        in_names=tuple(n.name for n in tensor_inputs),
        in_shapes=tuple(tuple(leaves[p].shape) for p in tensor_positions),
        kwarg_order=tuple(kwargs),
        out_spec=ep.call_spec.out_spec,
        out_constants=out_constants,
        out_count=len(user_out),
    )
    options = {"granularity": granularity, "blocks_per_layer": blocks_per_layer}
    signature = _signature(model, infos, io, options)
    seq = LayerSequence(layers, infos, io, tied, signature, model_name=name or type(model).__name__, options=options,
                        notes=attention.notes)
    seq.attention = attention
    seq.layer_entries = _layer_entries(segments)
    seq.hf_tp_plan = hf_tp_plan(model)  # what tensor parallelism shards by (graph.tp_plan.whole_weights)
    return seq


def _layer_entries(segments: list[Segment]) -> list[tuple[str, int] | None]:
    """Where each layer starts in the model's own forward: the first module call it enters (its
    path, and which call of it: ALBERT calls one layer several times), or None when it enters none.

    A layer starts at the outermost module on its first node's stack that the layer before had
    not entered (``transformer.h.3``, not ``transformer``, which layer 0 entered already). The
    untouched model, seeded there, draws the random numbers each layer draws in the pipeline
    (autopipe.runtime.checks.untouched).
    """
    entries: list[tuple[str, int] | None] = []
    before: set[str] = set()
    for seg in segments:
        stacks = [module_stack(n) for n in seg.nodes]
        first = next((s for s in stacks if s), [])
        found = next(((path, int(key.rsplit("@", 1)[1]) if "@" in key else 0)
                      for key, path, _ in first if key not in before), None)
        entries.append(found)
        last = next((s for s in reversed(stacks) if s), [])
        before = {key for key, _, _ in last}
    return entries


def _build_layer(
    seg: Segment,
    inputs: list[fx.Node],
    outputs: list[fx.Node],
    attr_of: dict[fx.Node, tuple[str, str, torch.Tensor]],
    constant_of: dict[fx.Node, Any],
    mutations: list[tuple[fx.Node, str]],
    model: nn.Module,
    index: int,
    names_of: dict[int, list[str]],
    holders: dict[fx.Node, tuple[str, BatchFreeValue, list[fx.Node]]],
    skip: set[fx.Node],
) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("autopipe_inputs")
    xt = g.call_function(as_tuple, (x,))
    env: dict[fx.Node, Any] = {}
    for j, v in enumerate(inputs):
        env[v] = g.call_function(operator.getitem, (xt, j))
        env[v].meta = dict(v.meta)
    attrs: dict[str, Any] = {}
    kinds: dict[str, str] = {}

    def lookup(a: fx.Node, user: fx.Node | None = None) -> Any:
        if a in env:
            return env[a]
        if a in constant_of:
            return constant_of[a]
        if a in holders:  # a batch-free value: made by its holder, shared with the other layers reading it
            name, holder, reads = holders[a]
            args = tuple(lookup(b) for b in reads)
            attrs[name] = holder
            env[a] = g.call_module(name, args)
            env[a].meta = dict(a.meta)
            return env[a]
        if a in attr_of:
            target, kind, tensor = attr_of[a]
            if kind == "parameter" and user is not None:
                target = _closest_name(user, names_of.get(id(tensor), [target]))
            attrs[target] = tensor
            kinds[target] = kind
            env[a] = g.get_attr(target)
            return env[a]
        if a.op == "get_attr":  # a subgraph of a higher-order op (autocast or no_grad regions)
            attrs[a.target] = without_trace_checks(getattr(a.graph.owning_module, a.target))
            env[a] = g.get_attr(a.target)
            return env[a]
        raise TraceError(f"value {a.name} is used by layer {index} but is not live into it (internal error).")

    for n in seg.nodes:
        if n.target in _TRACE_ONLY or n in skip:
            continue
        for a in n.all_input_nodes:
            lookup(a, n)
        env[n] = g.node_copy(n, lookup)
        env[n].meta = dict(n.meta)
    for value, target in mutations:
        buf = model.get_buffer(target)
        attrs[target] = buf
        kinds[target] = "buffer"
        g.call_function(_write_buffer, (g.get_attr(target), env[value]))
    outs = tuple(lookup(v) for v in outputs)
    g.output(outs[0] if len(outs) == 1 else outs)
    _clone_mutated_inputs(g, [env[v] for v in inputs])
    g.lint()
    gm = fx.GraphModule(attrs, g, class_name=f"Layer{index}")
    gm.autopipe_attrs = kinds  # what rebind_ re-reads: original name -> parameter/buffer/constant
    return gm


# Checks export inserts at .to() calls: they pin the traced device and dtype, so a layer traced on
# meta or in fp32 would refuse to run on the GPU or under autocast. Nothing uses their result.
_TRACE_ONLY = {torch.ops.aten._assert_tensor_metadata.default}


def without_trace_checks(module: Any) -> Any:
    """``module`` (a higher-order op's subgraph) with export's trace-only checks taken out, nested
    subgraphs too; anything else comes back as it is.

    torch <= 2.11 puts them inside autocast regions as well (Llama's rotary tables in fp32): a
    layer traced in fp32 then refused bf16 under autocast ("Tensor dtype mismatch! Expected: Float").
    """
    if not isinstance(module, fx.GraphModule):
        return module
    for node in list(module.graph.nodes):
        if node.target in _TRACE_ONLY and not node.users:
            module.graph.erase_node(node)
    for child in module.children():
        without_trace_checks(child)
    module.recompile()
    return module


def _clone_mutated_inputs(g: fx.Graph, inputs: list[fx.Node]) -> None:
    """Give in-place ops (``ReLU(inplace=True)``) a copy of a layer input to write into.

    A pipeline stage receives its inputs as leaves that require grad, and autograd forbids writing
    into those. Every use in the layer, outputs included, then sees the written copy, as in the model.
    """
    for node in inputs:
        if any(_writes(user, node) for user in node.users):
            with g.inserting_after(node):
                copy = g.call_function(torch.ops.aten.clone.default, (node,))
            node.replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)


def _writes(user: fx.Node, value: fx.Node) -> bool:
    target = user.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            given = user.args[i] if i < len(user.args) else user.kwargs.get(arg.name)
            if given is value:
                return True
    return False


def _closest_name(user: fx.Node, names: list[str]) -> str:
    """Of a tied tensor's names, the one under the module that uses it (wte in the embedding layer).

    Export routes every use of a tied tensor through one placeholder, whichever name it kept.
    """
    paths = [path for _, path, _ in module_stack(user)]

    def depth(name: str) -> int:
        return max((len(p) for p in paths if name.startswith(p + ".")), default=-1)

    return max(sorted(names), key=depth)


def _write_buffer(buffer: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        buffer.copy_(value)



def _find_tied(
    layers: list[fx.GraphModule], attr_of: dict[fx.Node, tuple[str, str, torch.Tensor]]
) -> tuple[list[TiedGroup], dict[str, str]]:
    """Tied = one parameter tensor reached by several names or held by several layers (identity)."""
    names: dict[int, set[str]] = {}
    users: dict[int, set[int]] = {}
    for target, kind, tensor in attr_of.values():
        if kind == "parameter":
            names.setdefault(id(tensor), set()).add(target)
    for i, layer in enumerate(layers):
        for target, kind in layer.autopipe_attrs.items():
            if kind == "parameter":
                users.setdefault(id(layer.get_parameter(target)), set()).add(i)
    groups: list[TiedGroup] = []
    canonical_of: dict[str, str] = {}
    for tid, ns in names.items():
        if len(ns) > 1 or len(users.get(tid, ())) > 1:
            ordered = tuple(sorted(ns))
            group = TiedGroup(canonical=ordered[0], names=ordered, layers=tuple(sorted(users.get(tid, ()))))
            groups.append(group)
            for n in ordered:
                canonical_of[n] = group.canonical
    groups.sort(key=lambda g: (g.layers, g.canonical))
    return groups, canonical_of


def _sig(node: fx.Node) -> TensorSig:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return TensorSig(node.name, tuple(int(s) for s in val.shape), str(val.dtype).replace("torch.", ""))
    return TensorSig(node.name, (), "unknown")


def _layer_info(
    i: int, seg: Segment, layer: fx.GraphModule, inputs: list[fx.Node], outputs: list[fx.Node], canonical_of: dict[str, str],
    computed: list[fx.Node],
) -> LayerInfo:
    params: dict[int, tuple[str, nn.Parameter]] = {}
    pnames = []
    for target, kind in layer.autopipe_attrs.items():
        if kind == "parameter":
            p = layer.get_parameter(target)
            params.setdefault(id(p), (target, p))
            pnames.append(target)
    tied = tuple(sorted({canonical_of[n] for n in pnames if n in canonical_of}))
    if is_glue(seg.key):
        # Containers ("transformer") say less than what they contain ("transformer.wte").
        paths = [p for p in seg.paths if not any(q.startswith(p + ".") for q in seg.paths)]
        label = ", ".join(paths[:3]) + (f" +{len(paths) - 3}" if len(paths) > 3 else "")
        name = label or "glue"
    else:
        call = seg.key.rsplit("@", 1)[1] if "@" in seg.key else ""
        name = seg.paths[0] if len(seg.paths) == 1 else f"{seg.paths[0]}..{seg.paths[-1]}"
        if call:
            name += f" (call {int(call) + 1})"
    ins = tuple(_sig(v) for v in inputs)
    outs = tuple(_sig(v) for v in outputs)
    return LayerInfo(
        index=i,
        name=name,
        kind=seg.kind,
        params=sum(p.numel() for _, p in params.values()),
        param_names=tuple(pnames),
        inputs=ins,
        outputs=outs,
        tied=tied,
        structure=_structure_key(layer, ins),
        computed=tuple(_sig(v) for v in computed),
    )


def _structure_key(layer: fx.GraphModule, inputs: tuple[TensorSig, ...]) -> str:
    """Identical layers (same ops on same shapes and dtypes) get the same key: measured once."""
    h = hashlib.sha256()
    h.update(repr([(s.shape, s.dtype) for s in inputs]).encode())
    local: dict[fx.Node, int] = {}
    for k, n in enumerate(layer.graph.nodes):
        local[n] = k
        if n.op == "get_attr":
            t = layer.get_submodule(n.target.rsplit(".", 1)[0]) if "." in n.target else layer
            value = getattr(t, n.target.rsplit(".", 1)[-1])
            if isinstance(value, fx.GraphModule):
                h.update(value.code.encode())
            else:
                h.update(f"attr{tuple(value.shape)}{value.dtype}".encode())
            continue
        if n.op == "call_module":  # a batch-free value's holder: what it makes is part of the layer
            h.update(layer.get_submodule(n.target).recipe.code.encode())
        args = n.args
        if n.target is EXPERTS_OP:  # its first argument numbers the call in this process: the class is the structure
            call = experts_call_of(n)
            args = (type(call.module).__qualname__ if call is not None else "", *n.args[1:])
        argrepr = repr(fx.node.map_arg((args, n.kwargs), lambda a: f"%{local[a]}"))
        h.update(f"{n.op}|{n.target}|{argrepr}".encode())
    return h.hexdigest()[:16]


def _signature(model: nn.Module, infos: list[LayerInfo], io: IOSpec, options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(type(model).__qualname__.encode())
    h.update(repr(sorted(options.items())).encode())
    h.update(repr((io.in_names, io.in_shapes)).encode())
    for info in infos:
        h.update(f"{info.name}|{info.structure}|{info.params}".encode())
    return h.hexdigest()[:16]


def _unfake(t: torch.Tensor) -> torch.Tensor:
    """A constant made while tracing on fake tensors holds no values, as one made on meta: meta then."""
    from torch._subclasses.fake_tensor import FakeTensor

    return torch.empty(t.shape, dtype=t.dtype, device="meta") if isinstance(t, FakeTensor) else t


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))


def _validate(model: nn.Module, seq: LayerSequence, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run the eager model and the sequence on the same inputs, RNG and buffers; compare outputs."""
    saved = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    # every generator the model can draw from: dropout on a GPU draws from that GPU's, not the CPU's
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    rng = RngState.capture([*saved.values(), *model.parameters(), *leaves])

    def restore() -> None:
        with torch.no_grad():
            for k, v in model.state_dict(keep_vars=True).items():
                if k in saved:
                    v.copy_(saved[k])

    try:
        with torch.no_grad():
            ref = model(*args, **kwargs)
            restore()
            rng.restore()
            got = seq(*args, **kwargs)
    finally:
        restore()
        rng.restore()
    ref_leaves = [x for x in pytree.tree_leaves(ref) if isinstance(x, torch.Tensor)]
    got_leaves = [x for x in pytree.tree_leaves(got) if isinstance(x, torch.Tensor)]
    if len(ref_leaves) != len(got_leaves):
        raise TraceMismatchError(
            f"the traced {type(model).__name__} returns {len(got_leaves)} tensors, the eager model "
            f"{len(ref_leaves)}; the trace dropped or added outputs. Set validate=False only if you know why."
        )
    for k, (r, g) in enumerate(zip(ref_leaves, got_leaves)):
        if r.shape != g.shape or not torch.allclose(r.float(), g.float(), rtol=1e-4, atol=1e-5 * max(1.0, float(r.abs().max()) if r.numel() else 1.0)):
            diff = (r.float() - g.float()).abs().max().item() if r.shape == g.shape else float("nan")
            raise TraceMismatchError(
                f"the traced {type(model).__name__} differs from the eager model in output {k} "
                f"(max difference {diff:.3g}, shapes {tuple(r.shape)} vs {tuple(g.shape)}): the graph took "
                "another branch than eager Python (e.g. a check that is false while tracing). "
                "Make that branch independent of tracing, or report the model."
            )
