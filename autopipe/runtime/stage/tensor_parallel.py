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
  (DTensor's implicit replication, switched on for the process, backward included);
- partial sums are summed where Megatron sums them (:func:`settle_partials_`, nodes around each
  matmul of the layer's graph): a rowwise matmul's output at once, and in backward a colwise
  matmul's input gradient at once, one per shared input. Left to DTensor's propagation a partial
  sum rode on through the residual add and the next colwise matmul ran on an all-gathered weight:
  a Llama block at tp 2 then made 19 collectives a micro-batch (8 all-reduces, 8 all-gathers, 3
  reduce-scatters) where Megatron makes 4 all-reduces, as it now does.

So the numbers are the untouched model's on any layout; the plan only decides the efficiency (which
matmuls run on a shard, which collectives run). A layer DTensor cannot run runs *replicated*, with
plain tensors, identical on every tp rank and without collectives, and the log says which:

- a layer that draws random numbers (dropout): DTensor's RNG gives a sharded op other masks than
  the untouched model's (and autopipe seeds each layer per micro-batch to match it);
- a layer whose forward or backward fails on meta DTensors at build time (custom ops such as
  ``autopipe::opaque_function``);
- a MoE block under expert parallelism (its experts call dispatches plain tensors over the ep group);
- the layers sharing a tied tensor with such a layer (one placement per tied tensor).

A MoE block without expert parallelism runs on DTensors around its experts: the job traces each
experts call as one op (autopipe.graph.expert_calls), and :func:`local_experts` runs it whole on
each tp rank's local tensors (DTensor has no rule for the grouped matmul or the eager loop's
``nonzero``), so the attention and the router run sharded as planned and the experts' weights stay
whole on every tp rank (Megatron's expert tensor parallelism of 1).

The decision is made on the meta model, for every layer, on every rank alike, so the holders of a
tied tensor agree without talking. The trial runs on meta, so an op DTensor lacks only on the real
device's kernel is found at the first step instead (one line naming the layer and the op). On a CPU
attention runs torch's math kernel under tp (DTensor has no rule for the CPU flash kernel); on a GPU
torch picks (flash and efficient attention have rules).

What composes (each tested against the untouched model, tp 2 x 2 stages on gloo): every schedule
(GPipe, 1F1B, Interleaved1F1B, ZBV: a tied tensor's second leaf on one rank is a DTensor over the
same local storage); data parallelism over the mesh's dp dimension with ``replicate`` (ZeRO 0, and
ZeRO 1 with ZeroRedundancyOptimizer stepping the shards' local tensors; DDP takes no DTensor) or FSDP2
(ZeRO 2/3, 2-D with the tp placements); the global gradient norm (a
shard counted on each tp rank, a replicated tensor on tp rank 0 only); tied-gradient sums (per tp
rank, shard by shard); torch.distributed.checkpoint (resumable on another tp degree); ``--verify``
(sharded gradients gathered first). Refused in one line: DeepSpeed's engine, heads or KV heads that tp does not
divide, a tp that does not divide the world or exceeds a node. Limits: every tp rank materialises its stage's whole weights
before keeping its shards (the build's peak is a tp=1 stage's); MoE experts are never split over tp (with ``--ep`` they are
shared out over the replicas at each tp rank: autopipe.runtime.stage.expert_parallel); DeepSpeed's engine runs no tp.

**Sequence parallelism** (``sequence_parallel=True``, Megatron's, arXiv 2205.05198): the activations
*between* layers travel sharded on the sequence instead of whole. Which values those are is read off
the trace, by position: a layer input or output that is floating, three-dimensional and as long as
the token ids on dim 1 (``[batch, seq, hidden]``: the residual stream) is a ``Shard(1)`` DTensor
inside a layer and its local piece outside it; the first layer's inputs (the data) and the last
layer's outputs (what the loss reads) stay whole, and the last layer gathers its inputs whole on
entry (Megatron gathers before its output layer too; DTensor would take the loss, a mean over the
tokens not ignored, as the mean of the shards' means: measured 4.5817 for 4.5823). So a layer ending in a rowwise matmul
reduce-scatters where it all-reduced, the norms and residual adds run on 1/tp of the tokens, a
colwise matmul all-gathers its input first (DTensor's sharding propagation decides, and the numbers
stay the untouched model's), and the pipeline sends 1/tp of each activation. A layer run replicated
gathers its sequence inputs whole and keeps its part of its outputs, gradients included; so does a
MoE block on DTensors (``TPLayout.gather_in``: its router and experts read every token), which runs
as without SP inside (its attention all-reduces). A
replicated parameter (a norm's weight) meeting sharded tokens has one part of its gradient per tp
rank (Megatron all-reduces the layernorm gradients for it): DTensor's backward sums them into the
parameter's own placement already (Llama, GPT-2 and Qwen3-MoE under SP left 0 ``Partial`` gradients
on every rank, counted 2026-12-07); :func:`reduce_partial_grads_` sums any that a layer leaves
``Partial``, once per step, before the norm. With replicas (ZeRO 0: ``replicate``; ZeRO 2/3: FSDP2, its
gradients sharded on the dp dimension of the same 2-D mesh) each replica's partial gradients are
averaged (reduce-scattered) over the replicas first, then summed over the tp ranks (the two sums
commute; each tp rank's FSDP2 shard keeps its part of the sum until then). Refused in one line: a
sequence tp does not divide, a model with no token ids.
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
from ...graph.tp_plan import agree_on_tied_dims, hf_tp_plan, shard_dims, tp_plan

__all__ = ["TPLayout", "apply_tensor_parallel_", "check_heads", "plan_tensor_parallel", "reduce_partial_grads_",
           "replicated_over_tp", "sequence_length", "sequence_positions", "settle_partials_", "shard_layer_",
           "swap_parameters_", "tp_sharded"]


@dataclass
class TPLayout:
    """How a tp degree runs each layer: its parameters' kinds and shard dims, or replicated."""

    tp: int
    kinds: dict[str, str] = field(default_factory=dict)  # parameter -> colwise/rowwise/vocab/replicate
    dims: dict[str, int | None] = field(default_factory=dict)  # parameter -> shard dim (None: Replicate)
    replicated: dict[int, str] = field(default_factory=dict)  # layer index -> why it runs with plain tensors
    plan_source: str = "derived"  # "hf" when the model's own _tp_plan decided the kinds
    sequence_parallel: bool = False
    # layer index -> positions of its inputs / outputs that travel sharded on the sequence (dim 1)
    seq_in: dict[int, tuple[int, ...]] = field(default_factory=dict)
    seq_out: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # layers whose sequence inputs are gathered whole on entry: the last (its loss is a mean over the tokens
    # that are not ignored, which DTensor takes as a mean of the shards' means on a sequence-sharded input)
    gather_in: tuple[int, ...] = ()
    seq_len: int = 0  # tokens per row under sequence parallelism (0: off)
    local_experts: tuple[int, ...] = ()  # layers on DTensors whose MoE experts run whole on each tp rank

    def settle_len(self, index: int) -> int:
        """The sequence length layer ``index`` settles its partial sums at (:func:`settle_partials_`): 0 for
        a MoE block gathered on entry, which runs as without sequence parallelism inside."""
        return 0 if index in self.local_experts else self.seq_len

    def describe(self, seq: Any) -> str:
        """One line for the log: the plan's source, what is sharded, which layers run replicated and why."""
        sharded = sum(1 for d in self.dims.values() if d is not None)
        head = (f"tp {self.tp}: {sharded} of {len(self.dims)} parameters sharded "
                f"({'the model' + chr(39) + 's HF tp_plan' if self.plan_source == 'hf' else 'plan derived from the graph'})")
        if self.sequence_parallel:
            head += f"; sequence parallel: {sum(map(len, self.seq_out.values()))} activations sent sharded on the sequence"
        if self.local_experts:
            head += (f"; the MoE experts of {len(self.local_experts)} layer(s) run whole on every tp rank, their "
                     "attention sharded")
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


def sequence_length(seq: Any, tp: int) -> int:
    """Tokens per row: dim 1 of the first layer's token ids (an integer ``[batch, seq]`` input). One
    line when the model has none or ``tp`` does not divide it."""
    first = seq.infos[0].inputs if seq.infos else ()
    length = next((s.shape[1] for s in first if len(s.shape) == 2 and not getattr(torch, s.dtype).is_floating_point), None)
    if length is None:
        raise AutopipeError("--sequence-parallel needs token inputs ([batch, seq] ids) to find the sequence by; this "
                            "model's first layer takes none: run tp without --sequence-parallel.")
    if length % tp:
        raise AutopipeError(f"--sequence-parallel: the sequence of {length} tokens does not split over tp {tp}; pick "
                            f"a --seq-len that tp divides, or run without --sequence-parallel.")
    return length


def sequence_positions(seq: Any, tp: int) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """Which inputs and outputs of each layer travel sharded on the sequence under sequence parallelism:
    by position, those floating, 3-D and as long as the token ids on dim 1 (the first layer's inputs and
    the last layer's outputs stay whole: the data and what the loss reads). One line when the model has
    no token ids or ``tp`` does not divide their length.

    >>> from types import SimpleNamespace as NS
    >>> from autopipe.graph.sequence import TensorSig
    >>> ids, h = TensorSig("ids", (2, 16), "int64"), TensorSig("h", (2, 16, 64), "float32")
    >>> infos = [NS(inputs=(ids,), outputs=(h,)), NS(inputs=(h,), outputs=(ids, h)), NS(inputs=(ids, h), outputs=(h,))]
    >>> sequence_positions(NS(infos=infos), 2)
    ({0: (), 1: (0,), 2: (1,)}, {0: (0,), 1: (1,), 2: ()})
    """
    length = sequence_length(seq, tp)

    def along(sigs: Any) -> tuple[int, ...]:
        return tuple(k for k, s in enumerate(sigs) if len(s.shape) == 3 and s.shape[1] == length
                     and getattr(torch, s.dtype).is_floating_point)

    last = len(seq.infos) - 1
    seq_in = {i: () if i == 0 else along(info.inputs) for i, info in enumerate(seq.infos)}
    seq_out = {i: () if i == last else along(info.outputs) for i, info in enumerate(seq.infos)}
    return seq_in, seq_out


def plan_tensor_parallel(seq: Any, model: nn.Module, tp: int, mesh: Any, *, sequence_parallel: bool = False,
                         expert_parallel: bool = False) -> TPLayout:
    """Every layer's placements and whether it runs replicated, decided on the meta model (call it
    before any tensor is materialised; every rank gets the same answer). ``sequence_parallel``: the
    activations between layers travel sharded on the sequence (the module docstring).
    ``expert_parallel``: the layers' experts calls dispatch over an ep group, and those layers run
    replicated; otherwise a layer holding one runs on DTensors around it (:func:`local_experts`)."""
    check_heads(model, tp)
    hf = hf_tp_plan(model)
    layout = TPLayout(tp=tp, plan_source="hf" if hf else "derived", sequence_parallel=sequence_parallel)
    if sequence_parallel:
        layout.seq_in, layout.seq_out = sequence_positions(seq, tp)
        layout.gather_in = (len(seq.layers) - 1,)
        layout.seq_len = sequence_length(seq, tp)
    tried: dict[tuple[Any, ...], str] = {}
    for i, layer in enumerate(seq.layers):
        kinds = tp_plan(layer, hf or None)
        dims = shard_dims(layer, kinds, tp)
        layout.kinds.update(kinds)
        layout.dims.update(dims)
        if draws_random(layer):
            layout.replicated[i] = "draws random numbers"
            continue
        if _holds_experts_call(layer):
            if expert_parallel:  # expert parallelism dispatches its tokens as plain tensors
                layout.replicated[i] = "its MoE experts run by expert parallelism"
                continue
            local_experts(layer)
            layout.local_experts = (*layout.local_experts, i)
            if sequence_parallel and i not in layout.gather_in:  # gathered on entry, run as without SP
                layout.gather_in = (*layout.gather_in, i)
        settle_partials_(layer, layout.settle_len(i))  # before the trial, so the trial runs what the steps will
        # an embedding's vocab shard runs as replicated in the trial: DTensor's MaskPartial keeps a mask
        # buffer in its cached sharding decision, and a meta one left there broke the real steps
        trial = {n: (None if kinds.get(n) == "vocab" else d) for n, d in dims.items()}
        seq_in = () if i in layout.gather_in else layout.seq_in.get(i, ())
        # identical layers (one structure key: the same ops on the same shapes) placed alike run alike:
        # one trial each (an 80-block model's rank tried 80 at every start, ~0.3 s of CPU each)
        structure = getattr(seq.infos[i], "structure", "")
        key = (structure, tuple(trial.get(n) for n, _ in layer.named_parameters(remove_duplicate=False)), seq_in)
        if structure and key in tried:
            why = tried[key]
        else:
            why = tried[key] = _meta_trial(layer, seq.infos[i], trial, mesh, seq_in)
        if why:
            layout.replicated[i] = why
    _agree_on_tied(seq, layout)
    # a MoE block that failed its trial, or shares a tie with a replicated layer, runs replicated: not gathered
    # on entry as a DTensor block, and not counted as one (the log line and the price)
    layout.local_experts = tuple(i for i in layout.local_experts if i not in layout.replicated)
    last = len(seq.layers) - 1
    layout.gather_in = tuple(i for i in layout.gather_in if i == last or i not in layout.replicated)
    _forget_meta_shardings()
    return layout


def local_experts(layer: nn.Module) -> int:
    """Run each ``autopipe::experts_call`` of ``layer`` on this tp rank's local tensors, whole (returns
    how many). DTensor has no rule for the experts' grouped matmul or the eager loop's ``nonzero``, so
    the call's inputs are made replicated and local (``to_local``, differentiable), the module's own
    forward (or the runner set before) runs on them, and its output comes back as a replicated
    DTensor: the experts' weights are whole on every tp rank, the rest of the block (attention, the
    router) runs sharded as planned. Every tp rank holds the same tokens, so each computes the same
    outputs and the same expert gradients, as a replicated parameter needs. Under sequence
    parallelism the block takes its input gathered whole (``TPLayout.gather_in``), since the
    router and the experts read every token."""
    from ...graph.expert_calls import experts_call_of

    done = 0
    for node in layer.graph.nodes:
        call = experts_call_of(node)
        if call is not None:
            if not getattr(call.runner, "autopipe_tp_local", False):
                call.runner = _local_runner(call.runner)
            done += 1
    return done


def _local_runner(inner: Any) -> Any:
    def run(call: Any, hidden: Any, top_k_index: Any, top_k_weights: Any, state: list[Any]) -> Any:
        from torch.distributed.tensor import DTensor, Replicate

        def experts(*args: Any) -> Any:  # the runner set before (expert parallelism's), else the module's own
            return inner(call, *args) if inner is not None else call.run_local(*args)

        if not isinstance(hidden, DTensor):  # a replicated layer, or a plain pass (shapes)
            return experts(hidden, top_k_index, top_k_weights, state)
        mesh = hidden.device_mesh

        def local(t: Any) -> Any:
            if not isinstance(t, DTensor):
                return t
            return t.redistribute(t.device_mesh, [Replicate()] * t.device_mesh.ndim).to_local()

        h, idx, w, st = local(hidden), local(top_k_index), local(top_k_weights), [local(t) for t in state]
        if h.device.type == "meta":  # planning's trial: the experts' own ops cannot run on meta
            out = h * 1
        else:
            out = experts(h, idx, w, st)
        return DTensor.from_local(out, mesh, [Replicate()] * mesh.ndim, run_check=False)

    run.autopipe_tp_local = True  # type: ignore[attr-defined]
    return run


def _holds_experts_call(layer: nn.Module) -> bool:
    """Whether the layer's graph calls ``autopipe::experts_call`` (a job traces them so under ep or tp)."""
    from ...graph.expert_calls import EXPERTS_OP

    graph = getattr(layer, "graph", None)
    return graph is not None and any(node.target is EXPERTS_OP for node in graph.nodes)


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
    agree_on_tied_dims(seq.tied, layout.dims)


def _placements(dim: int | None) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate()] if dim is None else [Shard(dim)]


def _meta_trial(layer: nn.Module, info: Any, dims: Mapping[str, int | None], mesh: Any,
                seq_in: tuple[int, ...] = ()) -> str:
    """'' when ``layer`` runs forward and backward on meta DTensors placed by ``dims``, else why not
    (the inputs at ``seq_in`` sharded on the sequence, as sequence parallelism sends them)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    try:
        state: dict[str, torch.Tensor] = {}
        for name, p in layer.named_parameters(remove_duplicate=False):
            dt = distribute_tensor(torch.empty(p.shape, dtype=p.dtype, device="meta"), mesh,
                                   _placements(dims.get(name)), src_data_rank=None)
            state[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
        for name, b in layer.named_buffers(remove_duplicate=False):
            state[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
        xs: list[Any] = []
        for k, sig in enumerate(info.inputs):
            dtype = getattr(torch, sig.dtype)
            t = torch.zeros(sig.shape, dtype=dtype, device="meta")
            if k in seq_in:
                t = distribute_tensor(t, mesh, [Shard(1)], src_data_rank=None)
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


def _positions(x: Any) -> list[Any]:
    """A layer's inputs or outputs by position: a tuple's items, else the one value."""
    return list(x) if isinstance(x, tuple) else [x]


def _repack(like: Any, items: list[Any]) -> Any:
    return tuple(items) if isinstance(like, tuple) else items[0]


def _map_at(x: Any, positions: tuple[int, ...], fn: Any) -> Any:
    """``x`` with ``fn`` applied to the tensors at ``positions`` (a tuple's items, or the one value)."""
    return _repack(x, [fn(t) if k in positions and isinstance(t, torch.Tensor) else t for k, t in enumerate(_positions(x))])


def _to_dtensors(x: Any, mesh: Any, seq_in: tuple[int, ...] = ()) -> Any:
    """Plain inputs as DTensors: replicated (every tp rank holds the same whole value), or, at the
    positions in ``seq_in``, this rank's piece of the sequence (``Shard(1)``)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def conv(k: int, t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            return DTensor.from_local(t, mesh, [Shard(1) if k in seq_in else Replicate()], run_check=False)
        return t

    return _repack(x, [conv(k, t) for k, t in enumerate(_positions(x))])


def _to_plain(out: Any, mesh: Any = None, seq_out: tuple[int, ...] = ()) -> Any:
    """DTensor outputs as plain tensors: whole (``full_tensor``: the all-reduce of a partial sum, the
    all-gather of a shard), or, at the positions in ``seq_out``, this rank's piece of the sequence
    (the reduce-scatter of a partial sum; a whole value is cut locally)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def whole(t: Any) -> Any:
        return t.full_tensor() if isinstance(t, DTensor) else t

    if not seq_out:
        return pytree.tree_map(whole, out)

    def piece(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, DTensor):  # a whole value (made from replicated ones): every tp rank keeps its part
            t = DTensor.from_local(t, mesh, [Replicate()], run_check=False)
        return t.redistribute(mesh, [Shard(1)]).to_local().contiguous()  # sent as is: gloo sends contiguous tensors

    return _repack(out, [piece(t) if k in seq_out else pytree.tree_map(whole, t) for k, t in enumerate(_positions(out))])


def _gathered(x: Any, mesh: Any, seq_in: tuple[int, ...]) -> Any:
    """The inputs at ``seq_in`` made whole from this rank's pieces (differentiable: the gradient
    goes back as this rank's piece); the others as they are."""
    from torch.distributed.tensor import DTensor, Shard

    return _map_at(x, seq_in, lambda t: DTensor.from_local(t, mesh, [Shard(1)], run_check=False).full_tensor())


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


def _dtensor_forward(forward: Any, mesh: Any, layer: nn.Module | None = None, seq_in: tuple[int, ...] = (),
                     seq_out: tuple[int, ...] = (), whole_in: bool = False) -> Any:
    """``forward`` on DTensors: the inputs at ``seq_in`` arrive as sequence pieces (gathered whole
    first with ``whole_in``), the outputs at ``seq_out`` leave as pieces, everything else whole."""
    def run(x: Any) -> Any:
        if layer is not None and _on_meta(x):  # a data-free pass (shapes, FLOPs): plain, global shapes
            return _local_meta(_meta_forward(layer, forward, _global_meta(x, mesh.size(), seq_in)), mesh.size(), seq_out)
        allow_implicit_replication()
        if whole_in:
            x = _gathered(x, mesh, seq_in)
        with _attention_kernels(mesh.device_type):
            return _to_plain(forward(_to_dtensors(x, mesh, () if whole_in else seq_in)), mesh, seq_out)

    run.autopipe_tp = True  # type: ignore[attr-defined]
    return run


def _replicated_forward(forward: Any, mesh: Any, seq_in: tuple[int, ...], seq_out: tuple[int, ...]) -> Any:
    """A layer run with plain tensors under sequence parallelism: its sequence inputs gathered whole,
    its sequence outputs cut to this rank's part (the gradient coming back is gathered whole, so
    every tp rank computes the same parameter gradients, as without sequence parallelism)."""
    def run(x: Any) -> Any:
        if _on_meta(x):
            return _local_meta(forward(_global_meta(x, mesh.size(), seq_in)), mesh.size(), seq_out)
        return _to_plain(forward(_gathered(x, mesh, seq_in)), mesh, seq_out)

    run.autopipe_tp = True  # type: ignore[attr-defined]
    return run


def _global_meta(x: Any, tp: int, seq_in: tuple[int, ...]) -> Any:
    """Meta stand-ins of the whole values for this rank's sequence pieces (the shape-inference pass)."""
    if not seq_in:
        return x

    def grow(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[1] *= tp
        return torch.empty(shape, dtype=t.dtype, device="meta", requires_grad=t.requires_grad)

    return _map_at(x, seq_in, grow)


def _local_meta(out: Any, tp: int, seq_out: tuple[int, ...]) -> Any:
    """What a rank sends of each sequence output on meta: a 1/tp slice of dim 1."""
    if not seq_out:
        return out
    return _map_at(out, seq_out, lambda t: t.narrow(1, 0, t.shape[1] // tp).contiguous())


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


def _is_partial(t: Any) -> bool:
    """Whether ``t`` is a DTensor holding a partial sum on some mesh dimension."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor) and any(p.is_partial() for p in t.placements)


# matmuls and the position of their activation input (the one whose gradient tp leaves partial)
_MATMULS = {"aten.linear.default": 0, "aten.mm.default": 0, "aten.addmm.default": 1, "aten.matmul.default": 0}


def _settle_partial(t: Any, seq_len: int, last: bool = False) -> Any:
    """A matmul's partial sum (a rowwise matmul's output) summed over the tp ranks at once: whole, or
    under sequence parallelism (``seq_len`` > 0, a ``[batch, seq, hidden]`` value) reduce-scattered on
    the sequence. Its gradient passes as it comes (Megatron's ``g``). ``last``: no matmul of the layer
    follows this one, so a sharded output (a head's colwise logits) is gathered whole here, once: left
    sharded, the loss beside it gathered the logits inside its op and the layer's output gathered them
    again (2 all-gathers of the largest tensor tp moves, counted by CommDebugMode). Anything else
    passes through."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if last and isinstance(t, DTensor) and any(p.is_shard() for p in t.placements) and not _is_partial(t):
        return t.redistribute(t.device_mesh, [Replicate()] * len(t.placements))
    if not _is_partial(t):
        return t
    seq = seq_len > 0 and t.dim() == 3 and t.shape[1] == seq_len
    return t.redistribute(t.device_mesh, [Shard(1) if seq else Replicate()])


class _SettleGrad(torch.autograd.Function):
    """The identity forward; backward, a partial gradient (what a colwise matmul gives its input)
    summed over the tp ranks at once (Megatron's ``f``), so the ops before it see a whole gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:  # noqa: D102
        from torch.distributed.tensor import Replicate

        if _is_partial(g):
            return g.redistribute(g.device_mesh, [Replicate()])
        return g


def _settle_input(t: Any, seq_len: int) -> Any:
    """A matmul's activation input, once per input however many matmuls read it: a sequence piece
    (sequence parallelism) all-gathered whole, its partial gradient reduce-scattered back
    (DTensor's own backward of the gather); else as it is, its partial gradient all-reduced."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    if seq_len > 0 and t.dim() == 3 and t.placements[0].is_shard(1):
        return t.redistribute(t.device_mesh, [Replicate()])
    return _SettleGrad.apply(t) if t.requires_grad else t


def settle_partials_(layer: nn.Module, seq_len: int = 0) -> int:
    """Sum partial sums where Megatron does, by nodes around every matmul of ``layer``'s fx graph
    (returns how many matmuls): its output's partial sum at once (after a rowwise matmul), and in
    backward its activation input's partial gradient at once (before a colwise one); under sequence
    parallelism its sequence-sharded input gathered once per input (q, k and v share one gather),
    the gradient reduce-scattered back. Left to
    DTensor, a partial sum flows on through the residual add and the next matmul takes it with its
    weight all-gathered, in forward and in backward: measured on the meta trial of a Llama block
    at tp 2, 19 collectives a micro-batch against Megatron's 4 with these (25 against 9 under
    sequence parallelism), and the MLP's matmuls on whole weights."""
    graph = getattr(layer, "graph", None)
    if not isinstance(graph, torch.fx.Graph) or any(n.target is _settle_partial for n in graph.nodes):
        return 0  # not a traced layer, or settled already
    done = 0
    shared: dict[torch.fx.Node, torch.fx.Node] = {}  # one gradient sum per input (q, k and v share theirs)
    matmuls = {n for n in graph.nodes if n.op == "call_function" and str(n.target) in _MATMULS}
    for node in list(graph.nodes):
        at = _MATMULS.get(str(node.target)) if node.op == "call_function" else None
        if at is None:
            continue
        last = not _reaches(node, matmuls)  # (a node never reaches itself: the graph has no cycles)
        x = node.args[at] if len(node.args) > at else None
        if isinstance(x, torch.fx.Node):
            if x not in shared:
                with graph.inserting_after(x):
                    shared[x] = graph.call_function(_settle_input, (x, seq_len))
            node.update_arg(at, shared[x])
        with graph.inserting_after(node):
            settled = graph.call_function(_settle_partial, (node, seq_len, last))
        node.replace_all_uses_with(settled, delete_user_cb=lambda user: user is not settled)
        done += 1
    if done:
        layer.recompile()
    return done


def _reaches(node: torch.fx.Node, targets: set[torch.fx.Node]) -> bool:
    """Whether any of ``targets`` uses ``node``'s value, directly or through other nodes."""
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n in targets:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return False


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


def shard_layer_(layer: nn.Module, index: int, layout: TPLayout, mesh: Any, made: dict[int, nn.Parameter]) -> bool:
    """Make layer ``index`` of the sequence run as ``layout`` says, in place: a replicated layer keeps
    plain parameters (under sequence parallelism its forward gathers and cuts the sequence values); a
    DTensor layer gets its partial sums settled, a DTensor of each parameter in ``made`` (by the old
    parameter's id, so a tensor shared with an earlier layer is made once) and a forward converting
    its inputs and outputs. The caller swaps the new parameters in (:func:`swap_parameters_`).
    Returns whether the layer runs on DTensors."""
    from torch.distributed.tensor import distribute_tensor

    seq_in, seq_out = layout.seq_in.get(index, ()), layout.seq_out.get(index, ())
    if index in layout.replicated:
        if seq_in or seq_out:
            layer.forward = _replicated_forward(layer.forward, mesh, seq_in, seq_out)
        return False
    settle_partials_(layer, layout.settle_len(index))  # a no-op where planning settled this layer already
    for name, p in layer.named_parameters(remove_duplicate=False):
        if id(p) not in made:
            dt = distribute_tensor(p.detach(), mesh, _placements(layout.dims.get(name)), src_data_rank=None)
            made[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
    layer.forward = _dtensor_forward(layer.forward, mesh, layer, seq_in, seq_out, index in layout.gather_in)
    return True


def swap_parameters_(module: nn.Module, made: Mapping[int, nn.Parameter]) -> None:
    """Put the parameters ``shard_layer_`` made in place of the ones they were made from."""
    for mod in module.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and id(p) in made:
                mod._parameters[attr] = made[id(p)]


def apply_tensor_parallel_(build: Any, layout: TPLayout, mesh: Any) -> None:
    """Turn this rank's chunks into tensor-parallel ones (see the module docstring): each parameter of
    a DTensor layer a DTensor on ``mesh``, each such layer's forward converting its inputs and outputs;
    ``build.params`` and ``build.aliases`` then hold the DTensor parameters."""
    from torch.distributed.tensor import DTensor

    lo: dict[int, nn.Parameter] = {}  # old parameter id -> new parameter
    for chunk in build.chunks:
        first = chunk.layer_range[0]
        for k, layer in enumerate(chunk.layers):
            shard_layer_(layer, first + k, layout, mesh, lo)
    for chunk in build.chunks:
        swap_parameters_(chunk, lo)
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


def reduce_partial_grads_(modules: Any) -> int:
    """Sum over the tp ranks each gradient left as a ``Partial`` DTensor (a replicated parameter, such
    as a norm's weight, that met sequence-sharded tokens: each tp rank holds its tokens' part), so
    every gradient has its parameter's placement before the norm and the step. Once per step; returns
    how many were summed."""
    done = 0
    seen: set[int] = set()
    for mod in modules:
        for _, p in mod.named_parameters(remove_duplicate=False):
            g = p.grad
            if id(p) in seen or not _is_partial(g):
                continue
            seen.add(id(p))
            p.grad = g.redistribute(g.device_mesh, p.placements)
            done += 1
    return done
