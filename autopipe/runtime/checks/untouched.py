"""The user's model, untouched: the reference a job's first step must equal.

``--verify`` and the tests compare the pipelined step with the model the factory builds, called
through its own ``forward`` (never the flattened layers), at the job's weights, on the same rows:
its outputs, its loss and every parameter's gradient. Two things make the comparison exact:

- ``untouched_model`` builds it with its constructor (every buffer as the model makes it:
  rotary tables, embedding scales, masks) and gives its parameters the job's values: read from
  the job's weights file (with the persistent buffers there), or made by the model's own per-module
  init, seeded per module as the job's ranks seed it (``autopipe.runtime.stage.weights``).
- ``seeded_like_pipeline`` seeds the RNG where each flattened layer starts in the model's own
  forward (``seq.layer_entries``), per micro-batch, as the pipeline seeds each layer
  (``MicrobatchSeeds``): with dropout on, both draw the same masks.

Example:
    >>> from autopipe.runtime.stage.build import build_stage
    >>> def make_model():
    ...     return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    >>> build = build_stage(make_model, (torch.randn(2, 4),), {}, 2, pp_rank=0, pp_size=1)
    >>> model = untouched_model(make_model, seed=0)
    >>> torch.equal(model[0].weight, build.model[0].weight)  # the job's weights, in the user's model
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ..stage.build import MicrobatchSeeds
from ..stage.weights import SafetensorsSource, init_weights_, load_weights_, tensor_names

__all__ = ["seeded_like_pipeline", "untouched_model"]


def untouched_model(model_fn: Callable[[], nn.Module], *, seed: int, weights: str | None = None,
                    device: torch.device | str = "cpu") -> nn.Module:
    """The model as ``model_fn`` builds it on ``device``, in training mode, at the job's weights.

    Only parameters (and, from a weights file, the buffers it holds) are set; every other buffer
    keeps the value the constructor gave it, so a buffer the job builds differently shows.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_fn()
    model.train()
    params = list({id(p): p for p in model.parameters()}.values())
    with torch.no_grad():
        if weights is not None:
            persistent = {id(t) for t in model.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)}
            held = [t for t in [*params, *model.buffers()] if id(t) in persistent]
            missing = set(load_weights_(model, held, SafetensorsSource(weights)))
            names = tensor_names(model)
            params = [p for p in params if names[id(p)][0] in missing]
        kept = {id(p): p.detach().clone() for p in params}
        # the job's ranks built from a constructor seeded with `seed` too: what no init writes is kept
        unwritten = set(init_weights_(model, params, seed=seed))
        names = tensor_names(model)
        for p in params:
            if names[id(p)][0] in unwritten:
                p.copy_(kept[id(p)])
    return model


@contextlib.contextmanager
def seeded_like_pipeline(model: nn.Module, entries: list[tuple[str, int] | None], seeds: MicrobatchSeeds | None
                         ) -> Iterator[None]:
    """While inside, each call of ``model`` is the next micro-batch, and the RNG is seeded where each
    layer starts (``entries``: ``seq.layer_entries``) as the pipeline seeds that layer for that
    micro-batch. ``seeds`` None seeds nothing."""
    if seeds is None:
        yield
        return
    state = {"mb": -1, "calls": {}}
    handles = []

    def start(module: nn.Module, args: Any) -> None:
        state["mb"] += 1
        state["calls"] = {}

    handles.append(model.register_forward_pre_hook(start))
    by_path: dict[str, list[tuple[int, int]]] = {}
    for layer, entry in enumerate(entries):
        if entry is not None:
            by_path.setdefault(entry[0], []).append((entry[1], layer))
    for path, calls in by_path.items():
        wanted = dict(calls)

        def enter(module: nn.Module, args: Any, path: str = path, wanted: dict[int, int] = wanted) -> None:
            n = state["calls"].get(path, 0)
            state["calls"][path] = n + 1
            if n in wanted:
                torch.manual_seed(seeds.layer_seed(state["mb"], wanted[n]))

        handles.append(model.get_submodule(path).register_forward_pre_hook(enter))
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for h in handles:
            h.remove()
