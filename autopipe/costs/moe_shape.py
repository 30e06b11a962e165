"""Each mixture-of-experts layer's :class:`MoeShape`: its experts and the token loads its router gives them.

Counted on the untouched model, not on the traced layers: a forward pre-hook on each experts module
(transformers 5's experts classes are called as ``experts(hidden_states, top_k_index, top_k_weights)``)
reads the router's top-k indices and counts them per expert, once per batch, over the batches given
(the profile's micro-batch, and more of the user's data where the job has some). Nothing is timed:
one forward per batch, under ``no_grad`` except the first, which also counts the FLOPs and the bytes
the experts keep for backward (what autopipe.costs.ep scales by the busiest rank's share). A model
on meta (an estimate) cannot run eagerly, so estimated profiles record none.

A routed expert runs each of its slots (token × top-k) through its own weights once, so its forward
FLOPs are ``2 · slots · params per expert``; torch's FLOP counter does not see grouped matmuls (the
experts' default kernel), so the larger of that and what it counted stands for the experts.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from .layer_costs import MoeShape, Profile

__all__ = ["counting_expert_flops", "expert_flops", "tally_expert_flops", "expert_modules", "count_loads", "moe_shapes", "with_moe_shapes"]

Batch = tuple[Sequence[Any], dict[str, Any]]


def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The routed-experts modules of ``model`` (qualified name, module): those called with the router's
    ``top_k_index``, as transformers 5's experts classes are."""
    out = []
    for name, module in model.named_modules():
        if not name or not hasattr(module, "num_experts"):
            continue
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            continue
        if "top_k_index" in params:
            out.append((name, module))
    return out


def _index_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """(hidden_states, top_k_index) of an experts call, positional or by keyword."""
    names = ("hidden_states", "top_k_index")
    got = [kwargs.get(n) for n in names]
    for i, n in enumerate(names):
        if got[i] is None and len(args) > i:
            got[i] = args[i]
    return got[0], got[1]


class _Counter:
    """Hooks on the experts modules: per module, the slots each expert got in the current batch."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self.modules = modules
        self.batch: dict[str, list[int]] = {}
        self.loads: dict[str, list[tuple[int, ...]]] = {n: [] for n, _ in modules}
        self.first: dict[str, tuple[int, int, int, int]] = {}  # name -> (tokens, top_k, hidden, element bytes)
        self.inside = ""
        self.handles: list[Any] = []

    def __enter__(self) -> "_Counter":
        for name, module in self.modules:
            self.handles.append(module.register_forward_pre_hook(self._pre(name, module), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post))
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def _pre(self, name: str, module: nn.Module) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden, index = _index_arg(args, kwargs)
            self.inside = name
            if index is None or hidden is None:
                return
            self.first.setdefault(name, (int(index.shape[0]), int(index.shape[-1]), int(hidden.shape[-1]),
                                         hidden.element_size()))  # fmt: skip
            e = int(module.num_experts)
            idx = index.reshape(-1).long()
            counts = torch.bincount(idx[(idx >= 0) & (idx < e)], minlength=e)[:e].tolist()
            have = self.batch.get(name)
            self.batch[name] = counts if have is None else [a + b for a, b in zip(have, counts)]

        return hook

    def _post(self, *_: Any) -> None:
        self.inside = ""

    def end_batch(self) -> None:
        for name, counts in self.batch.items():
            self.loads[name].append(tuple(int(c) for c in counts))
        self.batch = {}


def count_loads(model: nn.Module, batches: Iterable[Batch]) -> dict[str, list[tuple[int, ...]]]:
    """Per experts module (qualified name), per batch, the routed slots each expert received: the
    untouched model run forward on each batch (no grad), its experts' calls counted."""
    modules = expert_modules(model)
    counter = _Counter(modules)
    with counter, torch.no_grad(), torch.random.fork_rng(devices=[]):
        for args, kwargs in batches:
            model(*args, **kwargs)
            counter.end_batch()
    return counter.loads


def _layer_of(name: str, layer_names: Sequence[str]) -> int | None:
    """The flattened layer whose modules hold the module ``name`` (a layer's name lists its modules)."""
    for i, joined in enumerate(layer_names):
        for part in joined.split(", "):
            if part and (name == part or name.startswith(part + ".")):
                return i
    return None


def _strip_root(key: str) -> str:
    return key.split(".", 1)[1] if "." in key else ""


def moe_shapes(model: nn.Module, seq: Any, batches: Sequence[Batch]) -> dict[int, MoeShape]:
    """Per flattened layer index of ``seq``, the MoeShape of the experts module it holds; the first batch
    is the profile's micro-batch (its tokens and dispatch bytes are per micro-batch). {} without experts."""
    modules = expert_modules(model)
    if not modules or not batches or any(p.device.type == "meta" for p in model.parameters()):
        # on meta (an estimate) the untouched model cannot run eagerly (HF's masks read numbers from
        # tensors): no routing to count, so no MoeShape; such a profile is refused at ep > 1 in one line
        return {}
    names = [getattr(info, "name", "") for info in getattr(seq, "infos", [])]
    owner = {n: _layer_of(n, names) for n, _ in modules}
    counter = _Counter(modules)
    saved: dict[str, dict[int, int]] = {n: {} for n, _ in modules}

    # the experts' own weights are saved for backward too, but held anyway: not activations
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: Tensor) -> Tensor:
        if counter.inside:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in weights:
                saved[counter.inside][ptr] = t.untyped_storage().nbytes()
        return t

    flops = FlopCounterMode(display=False)
    was_training = model.training
    with counter, torch.random.fork_rng(devices=[]):
        args, kwargs = batches[0]
        with flops, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*args, **kwargs)
        del out
        counter.end_batch()
        with torch.no_grad():
            for args, kwargs in batches[1:]:
                model(*args, **kwargs)
                counter.end_batch()
    model.train(was_training)
    counted = {_strip_root(k): float(sum(v.values())) for k, v in flops.get_flop_counts().items()}
    shapes: dict[int, MoeShape] = {}
    for name, module in modules:
        i = owner[name]
        if i is None or name not in counter.first:
            continue
        tokens, k, hidden, elem = counter.first[name]
        layer_name = next(p for p in names[i].split(", ") if name == p or name.startswith(p + "."))
        layer = model.get_submodule(layer_name)
        expert_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
        layer_bytes = sum(p.numel() * p.element_size() for p in layer.parameters()) or 1
        per_expert = sum(p.numel() for p in module.parameters()) / max(int(module.num_experts), 1)
        experts_f = max(counted.get(name, 0.0), 2.0 * tokens * k * per_expert)
        rest_f = max(counted.get(layer_name, 0.0) - counted.get(name, 0.0), 0.0)
        shapes[i] = MoeShape(
            experts=int(module.num_experts), top_k=k, hidden=hidden, tokens=tokens,
            dispatch_bytes=tokens * k * hidden * elem, expert_param_share=expert_bytes / layer_bytes,
            expert_forward_share=experts_f / (experts_f + rest_f) if experts_f + rest_f > 0 else 0.0,
            expert_activation_bytes=int(sum(saved[name].values())), loads=tuple(counter.loads[name]),
        )  # fmt: skip
    return shapes


def with_moe_shapes(profile: Profile, shapes: dict[int, MoeShape]) -> Profile:
    """``profile`` with each layer's MoeShape set (layers absent from ``shapes`` keep theirs)."""
    from dataclasses import replace

    if not shapes:
        return profile
    return profile.with_layers([replace(l, moe=shapes.get(l.index, l.moe)) for l in profile.layers])


_TALLY: list[list[float]] = []  # open counting_expert_flops tallies, innermost last


def expert_flops(slots: int, state: list[torch.Tensor]) -> float:
    """Forward FLOPs of ``slots`` routed (token, expert) slots through experts whose stacked weights
    are ``state``: 2 per weight of one expert per slot, its matrices only (dim 3: experts × in × out;
    a bias adds no matmul FLOPs, as torch's FlopCounterMode counts). Every slot runs on some rank of
    the ep group, so the group's FLOPs are the untouched model's, whichever rank holds the expert.

    Example:
        >>> expert_flops(6, [torch.empty(4, 8, 16, device="meta"), torch.empty(4, 16, device="meta")])
        1536.0
    """
    return 2.0 * slots * sum(t.shape[1] * t.shape[2] for t in state if t.dim() == 3)


@contextmanager
def counting_expert_flops() -> Iterator[list[float]]:
    """Tally the experts' forward FLOPs of the data-free passes run inside (a one-element list, read
    after the block): their dispatching call returns no rows there, so FlopCounterMode sees none."""
    tally = [0.0]
    _TALLY.append(tally)
    try:
        yield tally
    finally:
        _TALLY.remove(tally)


def tally_expert_flops(slots: int, state: list[torch.Tensor]) -> None:
    """Add ``expert_flops(slots, state)`` to the innermost open :func:`counting_expert_flops` tally;
    nothing when none is open (a data-free pass for shapes only)."""
    if _TALLY:
        _TALLY[-1][0] += expert_flops(slots, state)
