"""Policy of the flatten pass: which graph node belongs to which layer.

Each node of the exported graph carries the module calls it came from (``nn_module_stack``). The
first call of an indexed child (``transformer.h.3``, ``layers.17``, an ``nn.Sequential`` child) on
that stack is the node's block; repeated calls of one module carry ``@N`` and stay apart (ALBERT).
Runs of nodes with one key are layers. Glue around the blocks is keyed by its top-level module, so
``ln_f`` and ``lm_head`` can be layers of their own; parameter-free glue joins the next layer.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch import fx

__all__ = ["Segment", "segment", "group_blocks", "module_stack", "is_glue"]


@dataclass
class Segment:
    """Consecutive graph nodes that become one layer."""

    key: str | None  # module call key; None or "glue:..." for code around the blocks
    nodes: list[fx.Node] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # module paths seen, in order
    kind: str = "glue"
    has_params: bool = False


def module_stack(node: fx.Node) -> list[tuple[str, str, str]]:
    """(call key, module path, class name) from outermost to innermost, the root left out."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for key, (path, typ) in stack.items():
        if path == "":
            continue
        cls = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
        out.append((key, path, cls.rsplit(".", 1)[-1]))
    return out


_GLUE = "glue:"


def is_glue(key: str | None) -> bool:
    return key is None or key.startswith(_GLUE)


def _is_indexed(path: str) -> bool:
    return path.rsplit(".", 1)[-1].isdigit()


def segment(gm: fx.GraphModule, param_nodes: set[fx.Node], granularity: str) -> list[Segment]:
    # get_attr nodes (higher-order-op subgraphs) are not computation: each layer using one gets its own.
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    any_indexed = any(_is_indexed(p) for n in compute for _, p, _ in module_stack(n))

    def key_of(node: fx.Node) -> tuple[str | None, str, str]:
        stack = module_stack(node)
        if not stack:
            return None, "", "glue"
        if granularity == "leaf":
            return stack[-1]
        for entry in stack:
            # Without indexed children (a U-Net of named blocks), top-level children are the blocks.
            if _is_indexed(entry[1]) or not any_indexed:
                return entry
        # Glue is kept apart per top-level child (ln_f | lm_head), so each piece can be a layer.
        return _GLUE + stack[0][0], stack[-1][1], "glue"

    segments: list[Segment] = []
    node_key: dict[fx.Node, tuple[str | None, str, str]] = {}
    for node in compute:
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and node.args[0] in node_key:
            k = node_key[node.args[0]]  # a tuple's items stay with the op that made the tuple
        else:
            k = key_of(node)
        node_key[node] = k
        key, path, cls = k
        if not segments or segments[-1].key != key:
            segments.append(Segment(key=key, kind=cls if not is_glue(key) else "glue"))
        seg = segments[-1]
        seg.nodes.append(node)
        deepest = module_stack(node)[-1][1] if module_stack(node) else ""
        label = path if not is_glue(key) else deepest
        if label and label not in seg.paths:
            seg.paths.append(label)
        if any(a in param_nodes for a in node.all_input_nodes):
            seg.has_params = True
    return _merge(segments, granularity)


def _merge(segments: list[Segment], granularity: str) -> list[Segment]:
    """Parameter-free glue (masks, position ids, residual adds) joins the next layer."""
    out: list[Segment] = []
    pending: list[Segment] = []
    for seg in segments:
        small = not seg.has_params and (is_glue(seg.key) or granularity == "leaf")
        if small:
            pending.append(seg)
            continue
        for p in reversed(pending):
            seg.nodes[:0] = p.nodes
        pending = []
        out.append(seg)
    if pending:
        if out:
            for p in pending:
                out[-1].nodes.extend(p.nodes)
        else:
            merged = Segment(key=None)
            for p in pending:
                merged.nodes.extend(p.nodes)
                merged.paths.extend(x for x in p.paths if x not in merged.paths)
            out.append(merged)
    return out


def group_blocks(segments: list[Segment], k: int) -> list[Segment]:
    """Coarser layers: ``k`` consecutive blocks per layer (glue layers stay on their own)."""
    if k == 1:
        return segments
    out: list[Segment] = []
    run = 0
    for seg in segments:
        if not is_glue(seg.key) and out and not is_glue(out[-1].key) and run < k:
            out[-1].nodes.extend(seg.nodes)
            out[-1].paths.extend(seg.paths)
            out[-1].has_params |= seg.has_params
            run += 1
        else:
            out.append(Segment(seg.key, list(seg.nodes), list(seg.paths), seg.kind, seg.has_params))
            run = 1
    return out
