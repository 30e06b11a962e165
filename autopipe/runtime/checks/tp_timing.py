"""Each layer timed at a tp degree as the runtime runs it, in this one process: what ``convert --tp``
prices a CPU rank's compute by.

The shares of autopipe.costs.tp divide a layer's seconds as its FLOPs divide. A CPU's small layers
do not: DTensor dispatches every op of a tp layer in Python, so at hidden 256 a Llama block took as
long at tp 2 as at tp 1 (1.1x its forward, 0.87x its backward, bench/results/tp.md) where the shares
said 0.6 of it, and the plan priced a tp 2 step 1.25x short. So each layer is timed twice, beside
each other: plain, as the profile timed it, and as one tp rank of the job runs it (the placements,
settled partial sums and DTensor forward of autopipe.runtime.stage.tensor_parallel; under sequence
parallelism on its sequence piece), on a ``fake`` process group of the degree set up here for the
purpose. Its collectives return at once and cost nothing here: they are priced from the host's
measured links instead (autopipe.costs.tp), and a rank of a real job also waits for its peers there.
The ratio of the two is ``TpShape.timed``. Identical layers (one structure, one input signature) are
timed once.

What a rank's compute costs on a GPU is unverified this way (no GPU lent when this was written):
``convert --tp`` times on a CPU only and prices a GPU by the shares.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor, nn

from ...costs.devices import rank_threads
from ...costs.estimate import meta_copy
from ...costs.measure import time_layer
from ...errors import AutopipeError
from ...graph.sequence import retarget_device_
from ..stage.tensor_parallel import plan_tensor_parallel, shard_layer_, swap_parameters_

__all__ = ["time_at_tp"]


def time_at_tp(seq: Any, model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None, tp: int, *,
               sequence_parallel: bool = False, warmup: int = 2, repeats: int = 5) -> list[tuple[float, float]]:  # fmt: skip
    """Per layer of ``seq`` (on a CPU, its real tensors), its (forward, backward) seconds at degree ``tp``
    over its seconds plain, each layer fed the output of the one before it on the example batch
    (``args``, ``kwargs``: what the profile ran). ``model`` is the model ``seq`` was flattened from
    (its HF tp_plan and heads decide the placements, as in a job). ``seq`` is left as it was.

    Refused (AutopipeError) where this process already has a process group: the fake one of the
    degree needs to be the default while it times."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_available() and dist.is_initialized():
        raise AutopipeError("this process has a process group already; time the layers at tp in a process of "
                            "their own (autopipe convert does)")  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(rank_threads())  # as the profile timed them: a rank's threads
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        layout = plan_tensor_parallel(_on_meta(seq), model, tp, mesh, sequence_parallel=sequence_parallel)
        x: Any = _inputs(seq.pack_inputs(tuple(args), dict(kwargs or {})))
        ratios: list[tuple[float, float]] = []
        seen: dict[tuple[Any, ...], tuple[float, float]] = {}
        cpu = torch.device("cpu")
        for i, layer in enumerate(seq.layers):
            info = seq.infos[i] if getattr(seq, "infos", None) else None
            key = (info.structure, _signature(x), i in layout.gather_in) if info is not None and info.structure else None
            if key is None or key not in seen:
                was = layer.training
                layer.train()  # what a job trains: dropout on
                plain = time_layer(layer, x, device=cpu, warmup=warmup, repeats=repeats)
                work = copy.deepcopy(layer)
                made: dict[int, nn.Parameter] = {}
                shard_layer_(work, i, layout, mesh, made)
                swap_parameters_(work, made)
                at_tp = time_layer(work, _piece(x, layout.seq_in.get(i, ()), tp), device=cpu, warmup=warmup,
                                   repeats=repeats)  # fmt: skip
                del work, made
                layer.train(was)
                ratio = (at_tp.forward / plain.forward if plain.forward > 0 else 1.0,
                         at_tp.backward / plain.backward if plain.backward > 0 else 1.0)
                if key is not None:
                    seen[key] = ratio
            ratios.append(seen[key] if key is not None else ratio)
            with torch.no_grad():
                x = _inputs(layer(x))
        return ratios
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _on_meta(seq: Any) -> SimpleNamespace:
    """What planning reads of ``seq`` (its layers, infos and tied groups), the layers copied onto meta:
    the layout is decided on meta, as every rank of a job decides it, and ``seq`` is left as it was."""
    layers = []
    for layer in seq.layers:
        copied = meta_copy(layer)
        retarget_device_(copied, "meta", constants=False)
        layers.append(copied)
    return SimpleNamespace(layers=layers, infos=seq.infos, tied=getattr(seq, "tied", ()))


def _inputs(value: Any) -> Any:
    """A layer's output as the next layer's input: detached, floating tensors requiring grad."""
    def leaf(t: Any) -> Any:
        if not isinstance(t, Tensor):
            return t
        t = t.detach()
        return t.requires_grad_(True) if t.is_floating_point() else t

    return tuple(leaf(t) for t in value) if isinstance(value, tuple) else leaf(value)


def _piece(x: Any, positions: tuple[int, ...], tp: int) -> Any:
    """What tp rank 0 receives of ``x``: under sequence parallelism its 1/tp of each value at ``positions``."""
    if not positions:
        return x
    items = list(x) if isinstance(x, tuple) else [x]
    for k in positions:
        t = items[k]
        items[k] = t.detach().narrow(1, 0, t.shape[1] // tp).contiguous().requires_grad_(t.requires_grad)
    return tuple(items) if isinstance(x, tuple) else items[0]


def _signature(x: Any) -> tuple[Any, ...]:
    items = x if isinstance(x, tuple) else (x,)
    return tuple((tuple(t.shape), t.dtype) if isinstance(t, Tensor) else type(t).__name__ for t in items)
