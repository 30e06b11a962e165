"""Attention as the eager model runs it: a traced causal mask becomes SDPA's ``is_causal``, and
key/value heads repeated for grouped-query attention become SDPA's ``enable_gqa``.

A HuggingFace decoder run eagerly without padding passes SDPA no mask (``is_causal=True``) and,
with fewer key/value heads than query heads, the un-repeated keys and values (``enable_gqa``).
Traced, it cannot know there is no padding: ``torch.export`` records the mask it builds from
``arange`` and comparisons (a ``[B, 1, L, S]`` boolean tensor) and ``repeat_kv``'s
``unsqueeze -> expand -> reshape``, which copies the keys and values to every query head and sums
their gradients back. On a GPU an explicit mask keeps SDPA off its flash kernel; on a CPU the
copies, the mask and the sums made autopipe's Llama job 4% slower than a bare torch pipeline at
the same cut (bench/results/overhead.md).

The rewrite is exact: a mask is replaced only when its value, computed here from the constants it
is made of, equals ``ones(L, S).tril()`` (SDPA's own causal mask) broadcast over every batch row
and head, as booleans or as 0 / -inf (or the dtype's lowest value) floats; keys and values only
when their repeat is the ``repeat_interleave`` that ``enable_gqa`` performs, and only where no mask
remains (HuggingFace's rule: some SDPA kernels refuse a mask with ``enable_gqa``).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, fx

from .batch_free import recipe
from .sequence import retarget_device_

__all__ = ["MAX_MASK_ELEMENTS", "AttentionRewrites", "simplify_attention"]

SDPA = torch.ops.aten.scaled_dot_product_attention.default
# A mask is evaluated to be checked; its recipe's intermediates are int64 tensors of its shape
# (256 MiB at this size). A larger one is left as traced, with a note.
MAX_MASK_ELEMENTS = 1 << 25
_RESHAPES = {torch.ops.aten.reshape.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}


@dataclass
class AttentionRewrites:
    """What ``simplify_attention`` did to a traced graph's SDPA calls (``LayerSequence.attention``)."""

    calls: int = 0  # SDPA calls in the graph
    causal: int = 0  # a traced causal mask replaced by is_causal=True
    gqa: int = 0  # repeated key/value heads replaced by enable_gqa=True
    masked: int = 0  # calls that still take a traced mask (not causal, or not checked)
    notes: list[str] = field(default_factory=list)  # masks left unchecked, and why

    def summary(self) -> str:
        """One line for `autopipe inspect`; empty without SDPA calls."""
        if not self.calls:
            return ""
        parts = [f"{self.causal} of {self.calls} SDPA calls causal without the traced mask (is_causal)"]
        if self.gqa:
            parts.append(f"{self.gqa} with grouped key/value heads (enable_gqa)")
        if self.masked:
            parts.append(f"{self.masked} with an explicit mask")
        return "attention: " + ", ".join(parts) + ", as the eager model calls SDPA"


def simplify_attention(gm: fx.GraphModule, batch_free: set[fx.Node], tensors: Mapping[fx.Node, Tensor],
                       constants: Mapping[fx.Node, Any]) -> AttentionRewrites:
    """Rewrite ``gm``'s SDPA calls in place (module docstring) and say what was rewritten.

    ``batch_free`` are the nodes whose value the batch does not change (``batch_free.batch_free_nodes``);
    ``tensors`` the buffers and lifted constants behind placeholders; ``constants`` the non-tensor
    inputs baked into the trace.
    """
    done = AttentionRewrites()
    causal_masks: dict[fx.Node, bool] = {}  # one mask feeds every block: check it once
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        done.calls += 1
        call = _bind(node)
        before = (done.causal, done.gqa)
        mask = call.get("attn_mask")
        if isinstance(mask, fx.Node) and not call.get("is_causal", False):
            if mask not in causal_masks:
                causal_masks[mask] = _is_causal_mask(mask, call, batch_free, tensors, constants, done.notes)
            if causal_masks[mask]:
                call["attn_mask"], call["is_causal"] = None, True
                done.causal += 1
        if call.get("attn_mask") is not None:
            done.masked += 1
        elif not call.get("enable_gqa", False):
            key, value = _unrepeated(call["key"]), _unrepeated(call["value"])
            heads = _shape(call["query"])
            if key and value and key[1] == value[1] and heads and heads[-3] == _shape(key[0])[-3] * key[1]:
                call["key"], call["value"], call["enable_gqa"] = key[0], value[0], True
                done.gqa += 1
        if (done.causal, done.gqa) == before:
            continue  # as traced
        old = list(node.all_input_nodes)
        node.args = (call.pop("query"), call.pop("key"), call.pop("value"))
        node.kwargs = {k: v for k, v in call.items() if not (k == "attn_mask" and v is None)}
        for a in old:
            _drop_if_unused(gm, a)
    if done.causal or done.gqa:
        gm.graph.lint()
        gm.recompile()
    return done


def _bind(node: fx.Node) -> dict[str, Any]:
    """The call's arguments by their schema names (only those given)."""
    names = [a.name for a in node.target._schema.arguments]
    call = dict(zip(names, node.args))
    call.update(node.kwargs)
    return call


def _shape(value: Any) -> tuple[int, ...] | None:
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    if not isinstance(val, Tensor):
        return None
    try:
        return tuple(int(d) for d in val.shape)
    except TypeError:  # a symbolic size: not this pass's business
        return None


def _is_causal_mask(mask: fx.Node, call: dict[str, Any], batch_free: set[fx.Node], tensors: Mapping[fx.Node, Tensor],
                    constants: Mapping[fx.Node, Any], notes: list[str]) -> bool:
    """Whether ``mask`` is SDPA's causal mask for this call's query and key lengths, everywhere."""
    q, k, shape = _shape(call["query"]), _shape(call["key"]), _shape(mask)
    if mask not in batch_free or q is None or k is None or shape is None or len(shape) < 2:
        return False
    numel = math.prod(shape)
    if numel > MAX_MASK_ELEMENTS:
        notes.append(f"attention mask {mask.name} ({numel} elements) left as traced: too large to check "
                     "whether it is causal; SDPA runs it as an explicit mask")
        return False
    graph, reads = recipe(mask, constants)
    inputs = [tensors.get(r) for r in reads]
    if any(t is None or t.is_meta or type(t) is not Tensor for t in inputs):
        return False  # made from tensors without values here (a model on meta): left as traced
    retarget_device_(graph, "cpu", constants=False)
    try:
        with torch.no_grad():
            value = graph(*[t.detach().cpu() for t in inputs])
    except Exception as e:  # an operator this CPU cannot run: the traced mask is kept, which is always right
        notes.append(f"attention mask {mask.name} left as traced: computing it to check it failed ({type(e).__name__})")
        return False
    length, keys = q[-2], k[-2]
    try:
        value = torch.broadcast_to(value, (*value.shape[:-2], length, keys))
    except RuntimeError:
        return False
    causal = torch.ones(length, keys, dtype=torch.bool).tril().expand_as(value)
    if value.dtype == torch.bool:
        return torch.equal(value, causal)
    if not value.is_floating_point():
        return False
    allowed = value == 0
    blocked = (value == float("-inf")) | (value == torch.finfo(value.dtype).min)
    return bool((allowed | blocked).all()) and torch.equal(allowed, causal)


def _unrepeated(value: Any) -> tuple[fx.Node, int] | None:
    """(the key/value tensor before ``repeat_kv``, its repeat) when ``value`` is
    ``x[:, :, None].expand(B, H, n, S, D).reshape(B, H * n, S, D)`` (each head n times in a row:
    the order ``enable_gqa``'s ``repeat_interleave`` makes), else None."""
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target in _RESHAPES):
        return None
    expand = value.args[0]
    if not (isinstance(expand, fx.Node) and expand.target is torch.ops.aten.expand.default):
        return None
    unsq = expand.args[0]
    if not (isinstance(unsq, fx.Node) and unsq.target is torch.ops.aten.unsqueeze.default and unsq.args[1] == 2):
        return None
    x = unsq.args[0]
    src, wide, out = _shape(x), _shape(expand), _shape(value)
    if src is None or wide is None or out is None or len(src) != 4 or len(wide) != 5:
        return None
    b, h, s, d = src
    n = wide[2]
    if wide != (b, h, n, s, d) or out != (b, h * n, s, d):
        return None
    return x, n


def _drop_if_unused(gm: fx.GraphModule, node: fx.Node) -> None:
    """Erase ``node`` and what only it used, once nothing reads it (pure calls only)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n.users or n.op != "call_function" or n.is_impure():
            continue
        if not (isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem):
            continue
        inputs = n.all_input_nodes
        gm.graph.erase_node(n)
        todo.extend(inputs)
