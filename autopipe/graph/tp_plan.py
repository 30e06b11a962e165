"""Which parameters of a flattened layer tensor parallelism shards, and along which dimension.

One classification, used by the runtime (``autopipe.runtime.stage.tensor_parallel`` turns each kind
into a DTensor placement) and, later, by the cost model (what a tp degree divides and which
collectives it adds):

- ``colwise``: the weight of a matmul whose output is split along its features (Megatron's
  column-parallel: q/k/v, gate/up, GPT-2's ``c_attn`` and ``c_fc``); its bias is split the same way;
- ``rowwise``: the weight of a matmul that takes a colwise matmul's output (o_proj, down_proj,
  ``c_proj``): split along its input features, its output a partial sum (an all-reduce follows);
- ``vocab``: an embedding table split along the vocabulary;
- ``replicate``: everything else (norms, routers, expert stacks, biases of rowwise matmuls).

Where the model ships HuggingFace's own plan (``model._tp_plan``, module patterns with ``*`` for a
layer index, e.g. ``model.layers.*.self_attn.q_proj: colwise``) its styles decide. Otherwise the plan
is derived from the traced graph: a weight whose matmul output feeds, through pointwise, view,
attention and other head-parallel ops only, another weight's matmul is colwise and that one rowwise.

The kinds are a choice of efficiency, never of correctness: the runtime runs the graph on DTensors,
whose sharding propagation keeps the graph's (global) shapes valid and inserts whatever
collective a placement needs, so any classification gives the same numbers.

Shard dimensions: ``aten.linear`` keeps its weight as ``[out, in]`` (colwise dim 0, rowwise dim 1);
``aten.addmm``/``aten.mm`` (GPT-2's Conv1D) as ``[in, out]`` (colwise dim 1, rowwise dim 0); an
embedding table is ``[vocab, hidden]`` (dim 0). A dimension that ``tp`` does not divide, and any
tensor of more than two dimensions (stacked MoE experts: expert parallelism is another matter),
stays replicated.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["KINDS", "agree_on_tied_dims", "hf_kind", "hf_tp_plan", "shard_dims", "tp_plan", "whole_weights"]

KINDS = ("colwise", "rowwise", "replicate", "vocab")

# ops a column-parallel activation passes through without being reduced (the walk from a colwise
# matmul's output to the rowwise matmul that consumes it); anything else ends the walk
_THROUGH = {
    "add", "sub", "mul", "div", "neg", "silu", "gelu", "relu", "tanh", "sigmoid", "exp", "pow", "sqrt", "rsqrt",
    "to", "_to_copy", "clone", "contiguous", "alias", "dropout", "native_dropout", "type_as",
    "view", "reshape", "_unsafe_view", "transpose", "permute", "unsqueeze", "squeeze", "expand", "split",
    "split_with_sizes", "chunk", "slice", "cat", "flatten", "unflatten", "t",
    "scaled_dot_product_attention", "softmax", "_softmax", "matmul", "bmm", "baddbmm", "where", "masked_fill",
    "repeat_interleave", "getitem",
}
_MATMULS = {"linear": (0, 1, 2), "addmm": (1, 2, 0), "mm": (0, 1, None), "matmul": (0, 1, None)}  # input, weight, bias


def hf_kind(style: str) -> str:
    """The kind of a HuggingFace tp_plan style (``colwise``, ``rowwise``, ``embedding_rowwise``,
    ``colwise_gather_output``, ``packed_colwise``...; anything else is ``replicate``).

    >>> hf_kind("colwise_gather_output"), hf_kind("embedding_rowwise"), hf_kind("ep_router")
    ('colwise', 'vocab', 'replicate')
    """
    s = str(style)
    if s.startswith("embedding"):
        return "vocab"
    if "colwise" in s:
        return "colwise"
    if "rowwise" in s and "local" not in s:
        return "rowwise"
    return "replicate"


def _op_name(target: Any) -> str:
    import operator

    if target is operator.getitem:
        return "getitem"
    name = getattr(target, "__name__", str(target))  # OpOverload: "linear.default"
    return name.split(".")[0]


def _param_nodes(gm: Any) -> dict[Any, str]:
    params = dict(gm.named_parameters(remove_duplicate=False))
    return {n: n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in params}


def _graph_roles(layer: Any) -> tuple[dict[str, str], dict[str, str]]:
    """(param -> derived kind, param -> how the graph uses it: ``linear``/``addmm``/``mm``/``embedding``/``bias:<op>``)."""
    from torch import fx

    kinds: dict[str, str] = {}
    usage: dict[str, str] = {}
    graphs = [m for m in layer.modules() if isinstance(m, fx.GraphModule)]
    for gm in graphs:
        pnodes = _param_nodes(gm)
        mms: dict[Any, tuple[str, str | None]] = {}  # matmul node -> (weight name, bias name)
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            op = _op_name(node.target)
            if op == "embedding" and node.args and node.args[0] in pnodes:
                usage.setdefault(pnodes[node.args[0]], "embedding")
                kinds.setdefault(pnodes[node.args[0]], "vocab")
            if op in _MATMULS:
                i, w, b = _MATMULS[op]
                args = list(node.args)
                weight = args[w] if len(args) > w else None
                if weight not in pnodes:
                    continue
                bias = args[b] if b is not None and len(args) > b else None
                wname = pnodes[weight]
                usage.setdefault(wname, op)
                bname = pnodes.get(bias) if bias is not None else None
                if bname is not None:
                    usage.setdefault(bname, f"bias:{op}")
                mms[node] = (wname, bname)
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        for node in sorted(mms, key=order.__getitem__):
            wname, bname = mms[node]
            if wname in kinds:
                continue
            reached = _reached_matmuls(node, mms)
            # a second colwise matmul feeding the same rowwise one (k and v beside q, up beside gate)
            free = [m for m in reached if kinds.get(mms[m][0]) in (None, "rowwise")]
            if not free:
                continue
            kinds[wname] = "colwise"
            if bname is not None:
                kinds[bname] = "colwise"
            for m in free:
                kinds[mms[m][0]] = "rowwise"
                if mms[m][1] is not None:
                    kinds.setdefault(mms[m][1], "replicate")
    return kinds, usage


def _reached_matmuls(start: Any, mms: Mapping[Any, Any], limit: int = 200) -> list[Any]:
    """The weight matmuls whose input ``start``'s output reaches through ``_THROUGH`` ops."""
    found, seen, todo = [], {start}, list(start.users)
    while todo and len(seen) < limit:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if node in mms:
            op = _op_name(node.target)
            inp = node.args[_MATMULS[op][0]]
            if inp in seen or inp is start:
                found.append(node)
            continue
        if node.op != "call_function" or _op_name(node.target) not in _THROUGH:
            continue
        todo.extend(node.users)
    return found


def _hf_match(patterns: Mapping[str, str], module: str) -> str | None:
    for pattern, style in patterns.items():
        regex = "^" + re.escape(pattern).replace(r"\*", r"\d+") + "$"
        if re.match(regex, module):
            return hf_kind(style)
    return None


def tp_plan(layer: Any, hf_plan: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each parameter of ``layer`` (by the untouched model's name) -> ``colwise``, ``rowwise``,
    ``vocab`` or ``replicate`` (see the module docstring). ``hf_plan``: the model's own
    ``_tp_plan`` (module pattern -> style); without one the plan is derived from the graph.

    >>> import torch
    >>> from autopipe.graph.flattener import flatten
    >>> class MLP(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    ...     def forward(self, x):
    ...         return self.down(torch.nn.functional.gelu(self.up(x)))
    >>> seq = flatten(torch.nn.Sequential(MLP(), MLP()), (torch.randn(2, 8),))
    >>> {k: v for layer in seq.layers for k, v in tp_plan(layer).items()}
    {'0.up.weight': 'colwise', '0.up.bias': 'colwise', '0.down.weight': 'rowwise', '0.down.bias': 'replicate', '1.up.weight': 'colwise', '1.up.bias': 'colwise', '1.down.weight': 'rowwise', '1.down.bias': 'replicate'}
    """
    names = [n for n, _ in layer.named_parameters(remove_duplicate=False)]
    if hf_plan:
        out = {}
        for n in names:
            module = n.rsplit(".", 1)[0] if "." in n else ""
            kind = _hf_match(hf_plan, n) or _hf_match(hf_plan, module) or "replicate"
            if kind == "rowwise" and n.endswith("bias"):
                kind = "replicate"
            out[n] = kind
        return out
    derived, _ = _graph_roles(layer)
    return {n: derived.get(n, "replicate") for n in names}


def shard_dims(layer: Any, plan: Mapping[str, str], tp: int) -> dict[str, int | None]:
    """Each parameter of ``plan`` -> the dimension its ``tp`` shards split (None: replicated), from
    how the graph uses it (see the module docstring)."""
    _, usage = _graph_roles(layer)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters(remove_duplicate=False)}
    out: dict[str, int | None] = {}
    for name, kind in plan.items():
        shape = shapes.get(name, ())
        use = usage.get(name, "")
        dim: int | None = None
        if kind == "vocab" and len(shape) == 2:
            dim = 0
        elif kind in ("colwise", "rowwise") and len(shape) == 2:
            transposed = use in ("addmm", "mm", "matmul")
            dim = (1 if transposed else 0) if kind == "colwise" else (0 if transposed else 1)
        elif kind == "colwise" and len(shape) == 1:
            dim = 0
        if dim is not None and (tp < 1 or shape[dim] % tp):
            dim = None
        out[name] = dim
    return out


def hf_tp_plan(model: Any) -> dict[str, str]:
    """The model's own HuggingFace ``_tp_plan`` (module pattern -> style), or {} where it has none."""
    plan = getattr(model, "_tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) else {}


def agree_on_tied_dims(tied: Any, dims: dict[str, int | None]) -> None:
    """A tied tensor has one placement: where the layers sharing it would split it differently (GPT-2's
    vocab-sharded embedding and its head, which the derived plan keeps whole), every name of it is
    replicated. ``dims``: name -> shard dim (None: replicated), updated in place."""
    for group in tied:
        seen = {dims.get(n) for n in group.names if n in dims}
        if len(seen) > 1:
            for n in group.names:
                if n in dims:
                    dims[n] = None


def whole_weights(seq: Any) -> list[frozenset[str]] | None:
    """Per layer of ``seq``, the parameters tensor parallelism keeps whole on every rank, as
    autopipe.runtime.stage.tensor_parallel plans them: the model's HF ``tp_plan`` (recorded by flatten
    as ``seq.hf_tp_plan``) or the plan derived from the graph, tied tensors agreeing on one placement.
    What the price of a layer at tp follows (autopipe.costs.tp_shape). None: the sequence records no
    plan source (made before flatten recorded it)."""
    hf = getattr(seq, "hf_tp_plan", None)
    if hf is None:
        return None
    dims: dict[str, int | None] = {}
    per_layer: list[list[str]] = []
    for layer in seq.layers:
        kinds = tp_plan(layer, hf or None)
        dims.update(shard_dims(layer, kinds, 1))
        per_layer.append(list(kinds))
    agree_on_tied_dims(getattr(seq, "tied", ()), dims)
    return [frozenset(n for n in names if dims.get(n) is None) for names in per_layer]
