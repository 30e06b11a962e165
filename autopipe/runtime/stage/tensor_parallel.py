"""Tensor parallelism inside each pipeline stage, on torch's DTensor: exact whatever the plan.

The flattened layers are fx graphs of aten ops with the trace's shapes baked in
(``aten.view(x, [2, 16, -1, 16])``, GQA's expand with literal head counts). Megatron-style local
weight slices would break those literals, so the layers run on DTensors instead, which keep every
shape global and decide the local work by sharding propagation:

- each parameter of a stage becomes a DTensor on the stage's 1-D tp mesh, placed by
  :func:`autopipe.graph.tp_plan.tp_plan` (the model's HuggingFace ``_tp_plan`` where it ships one,
  else paired matmuls derived from the graph): colwise -> ``Shard`` of the output features (bias
  too), rowwise -> ``Shard`` of the input features (bias replicated), vocab -> ``Shard(0)`` of an
  embedding table, everything else ``Replicate()``;
- each layer's tensors come in as replicated DTensors (``DTensor.from_local``) and its outputs
  leave as whole plain tensors (``full_tensor``: the all-reduce after a rowwise matmul, the
  all-gather after a colwise one that nothing reduced), so the pipeline's stages still send and
  receive plain tensors and every tp rank of a stage holds the same activations;
- plain tensors a graph makes or keeps (masks, rotary tables, constants) count as replicated
  (DTensor's implicit replication, switched on for the process, backward included).

So the numbers are the untouched model's on any layout; the plan only decides the efficiency (which
matmuls run on a shard, which collectives run). A layer DTensor cannot run runs *replicated*, with
plain tensors, identical on every tp rank and without collectives, and the log says which:

- a layer that draws random numbers (dropout): DTensor's RNG gives a sharded op other masks than
  the untouched model's (and autopipe seeds each layer per micro-batch to match it);
- a layer whose forward or backward fails on meta DTensors at build time (custom ops such as
  ``autopipe::opaque_function``, MoE expert loops with data-dependent indexing: ``nonzero``);
- the layers sharing a tied tensor with such a layer (one placement per tied tensor).

The decision is made on the meta model, for every layer, on every rank alike, so the holders of a
tied tensor agree without talking. The trial runs on meta, so an op DTensor lacks only on the real
device's kernel is found at the first step instead (one line naming the layer and the op). On a CPU
attention runs torch's math kernel under tp (DTensor has no rule for the CPU flash kernel); on a GPU
torch picks (flash and efficient attention have rules).

What composes (each tested against the untouched model, tp 2 x 2 stages on gloo): every schedule
(GPipe, 1F1B, Interleaved1F1B, ZBV: a tied tensor's second leaf on one rank is a DTensor over the
same local storage); data parallelism over the mesh's dp dimension with ``replicate`` (ZeRO 0; DDP
takes no DTensor) or FSDP2 (ZeRO 2/3, 2-D with the tp placements); the global gradient norm (a
shard counted on each tp rank, a replicated tensor on tp rank 0 only); tied-gradient sums (per tp
rank, shard by shard); torch.distributed.checkpoint (resumable on another tp degree); ``--verify``
(sharded gradients gathered first). Refused in one line: ZeRO 1 with replicas
(ZeroRedundancyOptimizer takes no DTensor), DeepSpeed's engine, heads or KV heads that tp does not
divide, a tp that does not divide the world or exceeds a node. Limits: every tp rank materialises its stage's whole weights
before keeping its shards (the build's peak is a tp=1 stage's); sequence parallelism is not done
(a plan with ``sequence_parallel`` is refused by train.py's preflight); MoE experts stay replicated (expert parallelism is
another matter); DeepSpeed's engine runs no tp.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import AutopipeError
from ...graph.rng import draws_random
from ...graph.tp_plan import shard_dims, tp_plan

__all__ = ["TPLayout", "apply_tensor_parallel_", "check_heads", "plan_tensor_parallel", "replicated_over_tp", "tp_sharded"]


@dataclass
class TPLayout:
    """How a tp degree runs each layer: its parameters' kinds and shard dims, or replicated."""

    tp: int
    kinds: dict[str, str] = field(default_factory=dict)  # parameter -> colwise/rowwise/vocab/replicate
    dims: dict[str, int | None] = field(default_factory=dict)  # parameter -> shard dim (None: Replicate)
    replicated: dict[int, str] = field(default_factory=dict)  # layer index -> why it runs with plain tensors
    plan_source: str = "derived"  # "hf" when the model's own _tp_plan decided the kinds

    def describe(self, seq: Any) -> str:
        """One line for the log: the plan's source, what is sharded, which layers run replicated and why."""
        sharded = sum(1 for d in self.dims.values() if d is not None)
        head = (f"tp {self.tp}: {sharded} of {len(self.dims)} parameters sharded "
                f"({'the model' + chr(39) + 's HF tp_plan' if self.plan_source == 'hf' else 'plan derived from the graph'})")
        if not self.replicated:
            return head + "; every layer runs on DTensors"
        why: dict[str, list[str]] = {}
        for i, reason in sorted(self.replicated.items()):
            why.setdefault(reason, []).append(f"{i} ({seq.infos[i].name})")
        return head + "; layers run replicated (plain tensors, no tp): " + "; ".join(
            f"{', '.join(layers)}: {reason}" for reason, layers in why.items())


def check_heads(model: nn.Module, tp: int) -> None:
    """One line when the attention heads (or KV heads) of ``model``'s config do not split over ``tp``."""
    config = getattr(model, "config", None)
    if config is None or tp == 1:
        return
    for attr in ("num_attention_heads", "n_head", "num_key_value_heads"):
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads > 0 and heads % tp:
            what = "KV heads" if "key_value" in attr else "attention heads"
            raise AutopipeError(f"the model's {heads} {what} ({attr}) do not divide over tp {tp}; pick a tp that "
                                f"divides {heads}.")


def _hf_plan(model: nn.Module) -> dict[str, str]:
    plan = getattr(model, "_tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) else {}


def plan_tensor_parallel(seq: Any, model: nn.Module, tp: int, mesh: Any) -> TPLayout:
    """Every layer's placements and whether it runs replicated, decided on the meta model (call it
    before any tensor is materialised; every rank gets the same answer)."""
    check_heads(model, tp)
    hf = _hf_plan(model)
    layout = TPLayout(tp=tp, plan_source="hf" if hf else "derived")
    for i, layer in enumerate(seq.layers):
        kinds = tp_plan(layer, hf or None)
        dims = shard_dims(layer, kinds, tp)
        layout.kinds.update(kinds)
        layout.dims.update(dims)
        if draws_random(layer):
            layout.replicated[i] = "draws random numbers"
            continue
        # an embedding's vocab shard runs as replicated in the trial: DTensor's MaskPartial keeps a mask
        # buffer in its cached sharding decision, and a meta one left there broke the real steps
        trial = {n: (None if kinds.get(n) == "vocab" else d) for n, d in dims.items()}
        why = _meta_trial(layer, seq.infos[i], trial, mesh)
        if why:
            layout.replicated[i] = why
    _agree_on_tied(seq, layout)
    _forget_meta_shardings()
    return layout


def _forget_meta_shardings() -> None:
    """Drop the sharding decisions DTensor cached during the meta trials: an embedding's cached
    ``MaskPartial`` keeps the trial's meta mask, which a real step then compared with its own."""
    from torch.distributed.tensor import DTensor

    cache = getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None)
    if cache is not None:
        cache()


def _agree_on_tied(seq: Any, layout: TPLayout) -> None:
    """A tied tensor has one placement: the layers sharing it with a replicated layer run replicated,
    and its kinds must agree (else it is replicated)."""
    changed = True
    while changed:
        changed = False
        for group in seq.tied:
            layers = list(group.layers)
            if any(i in layout.replicated for i in layers):
                for i in layers:
                    if i not in layout.replicated:
                        layout.replicated[i] = f"shares {group.canonical} with a replicated layer"
                        changed = True
    for group in seq.tied:
        dims = {layout.dims.get(n) for n in group.names if n in layout.dims}
        if len(dims) > 1:
            for n in group.names:
                layout.dims[n] = None


def _placements(dim: int | None) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate()] if dim is None else [Shard(dim)]


def _meta_trial(layer: nn.Module, info: Any, dims: Mapping[str, int | None], mesh: Any) -> str:
    """'' when ``layer`` runs forward and backward on meta DTensors placed by ``dims``, else why not."""
    from torch.distributed.tensor import distribute_tensor

    try:
        state: dict[str, torch.Tensor] = {}
        for name, p in layer.named_parameters(remove_duplicate=False):
            dt = distribute_tensor(torch.empty(p.shape, dtype=p.dtype, device="meta"), mesh,
                                   _placements(dims.get(name)), src_data_rank=None)
            state[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
        for name, b in layer.named_buffers(remove_duplicate=False):
            state[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        xs = []
        for sig in info.inputs:
            dtype = getattr(torch, sig.dtype)
            t = torch.zeros(sig.shape, dtype=dtype, device="meta")
            if dtype.is_floating_point:
                t.requires_grad_(True)
            xs.append(t)
        x: Any = xs[0] if len(xs) == 1 else tuple(xs)
        out = _call_with(layer, state, x, mesh)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.autograd.backward([t.sum() for t in leaves])
        return ""
    except Exception as e:  # noqa: BLE001 - any failure means: run this layer with plain tensors
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"DTensor cannot run it ({type(e).__name__}: {first[:120]})"


def _call_with(layer: nn.Module, state: Mapping[str, torch.Tensor], x: Any, mesh: Any) -> Any:
    from torch.nn.utils.stateless import _reparametrize_module

    with _reparametrize_module(layer, dict(state), tie_weights=False, strict=False):
        return _dtensor_forward(layer.forward, mesh)(x)


def _to_dtensors(x: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    def conv(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            return DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return t

    return tuple(conv(t) for t in x) if isinstance(x, tuple) else conv(x)


def _to_plain(out: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return pytree.tree_map(lambda t: t.full_tensor() if isinstance(t, DTensor) else t, out)


def allow_implicit_replication() -> None:
    """Plain tensors meeting DTensors count as replicated, in forward *and* backward (torch's
    ``implicit_replication`` context covers the forward only; the backward of ``cos * q`` meets the
    saved plain ``cos`` again). Sound here: on a tp rank every plain tensor is the same on all its
    tp ranks (whole activations, replicated constants). Set for the process once tp > 1."""
    from torch.distributed.tensor import DTensor

    DTensor._op_dispatcher._allow_implicit_replication = True


def _attention_kernels(device_type: str) -> Any:
    """The attention kernels DTensor can shard on ``device_type``: on a CPU the math one (DTensor has no
    sharding rule for ``_scaled_dot_product_flash_attention_for_cpu``; the math kernel is matmuls and a
    softmax, sharded over the heads); on a GPU torch's own choice (flash and efficient have rules)."""
    import contextlib

    if device_type != "cpu":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def _dtensor_forward(forward: Any, mesh: Any, layer: nn.Module | None = None) -> Any:
    def run(x: Any) -> Any:
        if layer is not None and _on_meta(x):  # a data-free pass (shapes, FLOPs): plain, global shapes
            return _meta_forward(layer, forward, x)
        allow_implicit_replication()
        with _attention_kernels(mesh.device_type):
            return _to_plain(forward(_to_dtensors(x, mesh)))

    run.autopipe_tp = True  # type: ignore[attr-defined]
    return run


def _on_meta(x: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in pytree.tree_leaves(x))


def _meta_forward(layer: nn.Module, forward: Any, x: Any) -> Any:
    """``layer`` on meta inputs (torch's PipelineStage infers the shapes it sends that way) with
    plain meta stand-ins of its DTensor parameters, of their global shapes: what it would output."""
    from torch.distributed.tensor import DTensor
    from torch.nn.utils.stateless import _reparametrize_module

    state = {n: torch.empty(p.shape, dtype=p.dtype, device="meta", requires_grad=p.requires_grad)
             for n, p in layer.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)}
    with _reparametrize_module(layer, state, tie_weights=False, strict=False):
        return forward(x)


def tp_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` (a parameter or gradient) is split over the tp ranks (its tp placement a Shard):
    each tp rank then holds a different part; otherwise every tp rank holds the same values."""
    mesh = getattr(p, "device_mesh", None)
    if mesh is None:
        return False
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return False
    return p.placements[names.index("tp")].is_shard()


def apply_tensor_parallel_(build: Any, layout: TPLayout, mesh: Any) -> None:
    """Turn this rank's chunks into tensor-parallel ones (see the module docstring): each parameter of
    a DTensor layer a DTensor on ``mesh``, each such layer's forward converting its inputs and outputs;
    ``build.params`` and ``build.aliases`` then hold the DTensor parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    lo = {}  # old parameter id -> new parameter
    dt_layers: list[nn.Module] = []
    for chunk in build.chunks:
        first = chunk.layer_range[0]
        for k, layer in enumerate(chunk.layers):
            if first + k in layout.replicated:
                continue
            dt_layers.append(layer)
            for name, p in layer.named_parameters(remove_duplicate=False):
                if id(p) in lo:
                    continue
                dt = distribute_tensor(p.detach(), mesh, _placements(layout.dims.get(name)), src_data_rank=None)
                lo[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            layer.forward = _dtensor_forward(layer.forward, mesh, layer)
    for chunk in build.chunks:
        for mod in chunk.modules():
            for attr, p in list(mod._parameters.items()):
                if p is not None and id(p) in lo:
                    mod._parameters[attr] = lo[id(p)]
    build.params = {n: lo.get(id(p), p) for n, p in build.params.items()}
    for name, leaves in build.aliases.items():
        main = build.params[name]
        for j, leaf in enumerate(leaves):
            new = lo.get(id(leaf))
            if new is None:
                continue
            # an alias leaf shares the main parameter's (local) storage, as before
            local = main.detach().to_local() if isinstance(main, DTensor) else main.detach()
            fresh = nn.Parameter(DTensor.from_local(local, mesh, new.placements, run_check=False),
                                 requires_grad=leaf.requires_grad)
            for chunk in build.chunks:
                for mod in chunk.modules():
                    for attr, p in list(mod._parameters.items()):
                        if p is new:
                            mod._parameters[attr] = fresh
            leaves[j] = fresh


def replicated_over_tp(params: Mapping[str, torch.Tensor]) -> set[str]:
    """Parameters every tp rank holds whole (a replicated DTensor or a plain tensor)."""
    return {n for n, p in params.items() if not tp_sharded(p)}

