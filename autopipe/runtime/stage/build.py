"""Build only this rank's part of the model: meta model -> flatten -> chunks -> materialise its tensors.

No rank ever holds the whole model: the model is constructed on the meta device (no memory),
flattened there, and only the parameters and buffers of this rank's layers get real storage, loaded
from a safetensors file or initialised per module (see ``weights``). ``build_reference`` builds the
whole model the same way, so the unpipelined reference starts from identical weights.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ...errors import AutopipeError
from ...graph.recompute import RecomputeError, check_mode, chunk_modes, run_layer
from ...graph.rng import draws_random
from ...graph.sequence import retarget_device_
from ...planner.plan import Plan
from ...planner.stage_plan import StagePlan
from .weights import (
    SafetensorsSource,
    init_weights_,
    load_weights_,
    materialize_,
    params_on_meta,
    tensor_names,
)

__all__ = ["MicrobatchSeeds", "PipeChunk", "StageBuild", "TiedSpec", "build_reference", "build_stage", "contiguous_grads", "local",
           "meta_model", "repoint_model_"]

ModelFn = Callable[[], nn.Module]


@dataclass(frozen=True)
class TiedSpec:
    """One tensor several layers share, and the pipeline ranks that hold a copy of it."""

    name: str  # the name the layers register it under
    names: tuple[str, ...]  # every name the model reaches it by
    holders: tuple[int, ...]  # pipeline ranks, sorted


@dataclass
class MicrobatchSeeds:
    """Where the random numbers of each layer and micro-batch come from (dropout, and any random op).

    Before each layer runs on micro-batch ``m`` of step ``step`` the RNG is seeded from
    ``(seed, step, first + m, layer index)``, so a layer draws the same masks whichever rank runs it,
    in whatever order the schedule interleaves micro-batches: a pipelined run equals the unpipelined
    one with dropout on. ``first`` is the global index of this replica's first micro-batch
    (``dp_rank x microbatches``), so replicas draw different masks, as one model on the global
    batch would.
    """

    seed: int
    step: int = 0
    first: int = 0

    def layer_seed(self, microbatch: int, layer: int) -> int:
        from .weights import module_seed

        return module_seed(self.seed, f"rng:{self.step}:{self.first + microbatch}:{layer}")


# The mode each layer was last given by a chunk, so a chunk rebuilt from the same layers without one
# (the one-process engine joins all chunks into one) still runs every layer as the plan said.
_LAYER_MODE: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


class PipeChunk(nn.Module):
    """Consecutive layers run as one pipeline stage, in the layer format both engines use.

    ``forward(*xs)`` takes the tensors crossing the cut before it (for the first chunk, the model's
    inputs as ``LayerSequence.pack_inputs`` orders them) and returns the tuple crossing the cut after
    it (for the last chunk, the model's flat outputs; ``LayerSequence.unpack_outputs`` rebuilds them).
    Under mixed precision the layers run in autocast; parameters stay fp32.

    ``recompute`` is the chunk's activation recompute mode (``none``, ``selective``, ``full``; see
    :mod:`autopipe.graph.recompute`), or one mode per layer; each layer is checkpointed on its own. None
    keeps the modes an earlier chunk gave these layers (none for fresh ones).
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        index: int,
        layer_range: tuple[int, int],
        recompute: str | Sequence[str] | None = None,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.index = index
        self.layer_range = layer_range
        self.autocast_dtype: torch.dtype | None = None
        # zero-bubble schedules detach stage outputs in place, which torch refuses for views
        self.unview_outputs = False
        if recompute is None:
            modes = [_LAYER_MODE.get(layer, "none") for layer in self.layers]
        elif isinstance(recompute, str):
            modes = [check_mode(recompute)] * len(self.layers)
        else:
            modes = [check_mode(m) for m in recompute]
            if len(modes) != len(self.layers):
                raise RecomputeError(
                    f"recompute gives {len(modes)} modes for a chunk of {len(self.layers)} layers; give one per layer."
                )
        self.recompute: tuple[str, ...] = tuple(modes)
        for layer, mode in zip(self.layers, modes):
            _LAYER_MODE[layer] = mode
        # set by the engine: per-layer RNG seeds for each micro-batch (see MicrobatchSeeds), and how
        # many micro-batches this chunk has run forward in the current step (schedules run a stage's
        # forwards in micro-batch order)
        self.seeds: MicrobatchSeeds | None = None
        self.microbatch = 0
        self.shape_inference = False  # set by the engine's stage while torch infers shapes
        # only a layer that draws random numbers is seeded: the seed is the same for the others,
        # which draw nothing, and costs 60 µs a call (autopipe.graph.rng.draws_random)
        self.draws = tuple(draws_random(layer) for layer in self.layers)

    def start_step(self, seeds: MicrobatchSeeds | None) -> None:
        self.seeds, self.microbatch = seeds, 0

    def forward(self, *xs: torch.Tensor) -> Any:
        xs = contiguous_grads(xs)
        x: Any = xs[0] if len(xs) == 1 else tuple(xs)
        device_type = xs[0].device.type if xs else "cpu"
        # the schedule's shape inference runs the chunk once on meta: not a micro-batch
        seeds = self.seeds if (self.seeds is not None and not self.shape_inference and device_type != "meta") else None
        mb = self.microbatch
        if seeds is not None:
            self.microbatch += 1
        with torch.autocast(
            device_type, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None
        ):
            for i, (layer, mode) in enumerate(zip(self.layers, self.recompute)):
                if seeds is not None and self.draws[i]:  # outside run_layer: a recomputation replays the state seeded here
                    torch.manual_seed(seeds.layer_seed(mb, self.layer_range[0] + i))
                x = run_layer(layer, x, mode)
        if self.unview_outputs:
            x = tuple(t.clone() if t._is_view() else t for t in x) if isinstance(x, tuple) else (
                x.clone() if x._is_view() else x
            )
        # what crosses a cut is sent as is and received into buffers shaped like it: an expanded mask
        # (BERT's, stride 0) made a non-contiguous receive buffer, which gloo refuses
        if isinstance(x, tuple):
            x = tuple(t if t.is_contiguous() else t.contiguous() for t in x)
        elif not x.is_contiguous():
            x = x.contiguous()
        return x


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient goes back contiguous."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def contiguous_grads(xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A stage's inputs, whose gradients (what the stage sends back over the cut) come out contiguous.

    A layer whose first op permutes what it receives (ConvNeXt's LayerNorm2d) gives its input a
    permuted gradient; the engines send it as it is, and gloo refuses a non-contiguous tensor
    ("input tensor has to be contiguous"; NCCL sends it wrongly strided). Forward outputs are
    made contiguous at the end of the chunk (PipeChunk, DSLayer).
    """
    return tuple(_ContiguousGrad.apply(x) if isinstance(x, torch.Tensor) and x.requires_grad else x for x in xs)


@dataclass
class StageBuild:
    """What one pipeline rank holds after building."""

    seq: Any  # LayerSequence (on meta except for this rank's tensors)
    model: nn.Module  # the meta model; this rank's tensors are real
    plan: StagePlan  # the plan as this run places it: every chunk's rank, the schedule, the world's layout
    pp_rank: int
    chunk_ids: list[int]
    chunks: list[PipeChunk]
    params: dict[str, nn.Parameter]  # this rank's parameters, each object once, sorted by name
    tied: list[TiedSpec]  # every tied tensor of the model (ranks that hold none included)
    # tied tensor name -> extra leaves sharing its storage, one per further local chunk using it
    aliases: dict[str, list[nn.Parameter]] = field(default_factory=dict)
    recompute: list[str] = field(default_factory=list)  # the recompute mode of every chunk of the plan
    # how the model was made: its factory, the init seed and the weights file (--verify rebuilds the
    # untouched model from them)
    model_fn: ModelFn | None = None
    seed: int = 0
    weights: str | None = None
    tp_layout: Any = None  # autopipe.runtime.stage.tensor_parallel.TPLayout when the stage runs tensor-parallel
    ep_layout: Any = None  # autopipe.runtime.stage.expert_parallel.EPLayout when its experts are shared out

    @property
    def layout(self) -> StagePlan:
        """``plan``, by the name train.py files written before StagePlan read it."""
        return self.plan

    def fold_alias_grads_(self) -> None:
        """Add the gradients of local alias leaves into the parameter they alias."""
        for name, leaves in self.aliases.items():
            main = self.params[name]
            for leaf in leaves:
                if leaf.grad is not None:
                    main.grad = leaf.grad.clone() if main.grad is None else main.grad.add_(leaf.grad)
                    leaf.grad = None

    @torch.no_grad()
    def sync_alias_params_(self) -> None:
        """Copy each tied tensor's value into its local alias leaves where they no longer share its
        storage (data parallelism gives every parameter storage of its own); after each update."""

        for name, leaves in self.aliases.items():
            main = local(self.params[name].detach())
            for leaf in leaves:
                mine = local(leaf.detach())
                if mine.data_ptr() != main.data_ptr():
                    mine.copy_(main)

    def tied_here(self) -> list[TiedSpec]:
        return [t for t in self.tied if self.pp_rank in t.holders]


def meta_model(model_fn: ModelFn) -> nn.Module:
    """Construct the model with every tensor on the meta device (no memory, no init cost)."""
    with torch.device("meta"):
        model = model_fn()
    model.train()
    return model


def retrace_with_sources_(seq: Any, retrace: Callable[[], Any]) -> None:
    """Give each layer of ``seq`` (traced without source lines) ``retrace``, which flattens the model again
    as ``seq`` was, with them, at most once: a failing rank's report
    (``autopipe.runtime.process.failures.describe``) finds its node's line there."""
    once = functools.cache(retrace)
    for layer in seq.layers:
        layer.autopipe_retrace = once


def to_meta(tree: Any) -> Any:
    return pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, tree)


def build_stage(
    model_fn: ModelFn,
    example_args: Sequence[Any],
    example_kwargs: dict[str, Any] | None,
    plan: StagePlan | Plan | Sequence[int] | int,
    *,
    pp_rank: int,
    pp_size: int,
    schedule: str | None = None,
    seed: int = 0,
    weights: str | None = None,
    device: torch.device | str = "cpu",
    granularity: str = "block",
    recompute: str | Sequence[str] | None = None,
    autocast: torch.dtype | None = None,
    tp_mesh: Any = None,
    ep_group: Any = None,
    sequence_parallel: bool = False,
) -> StageBuild:
    """Build pipeline rank ``pp_rank``'s chunks of the model ``model_fn`` makes.

    Args:
        model_fn: builds the model; called under ``torch.device("meta")``.
        example_args: one micro-batch of positional inputs (any device; only shapes are used).
        example_kwargs: its keyword inputs.
        plan: the record the runtime runs (``load_plan``, ``Plan.stage_plan()``), a ``Plan`` (read
            as its ``stage_plan()``), a list of S·v + 1 layer indices, or a number of chunks to cut
            evenly.
        pp_size: pipeline ranks the chunks are placed on (1: this process runs every chunk).
        schedule: the schedule the chunks run under (default: the plan's; 1F1B for a bare cut).
        weights: a safetensors file or HF folder to load from; None initialises from ``seed``.
        recompute: activation recompute, one mode for every chunk (``none``, ``selective``,
            ``full``) or one per chunk of the plan; None (or ``"plan"``) takes the plan's
            per-chunk modes when it has them, else none. Works with every schedule.
        autocast: the 16-bit dtype the step runs the layers under (``TrainConfig.autocast_dtype``):
            traced under it, as ``convert`` traced the plan's layers (``flatten``'s docstring).
        tp_mesh: this stage's 1-D tensor-parallel mesh (``DistEnv.tp_mesh``); None: no tensor
            parallelism. The chunks then run on DTensors (``autopipe.runtime.stage.tensor_parallel``).
        sequence_parallel: with ``tp_mesh``, the activations between layers travel sharded on the
            sequence (Megatron's sequence parallelism; the same module's docstring). Without tp
            (one process runs the plan whole) there is nothing to shard over and it is ignored.
        ep_group: this stage's ep group (``DistEnv.ep_group``); None: every rank holds every expert.
            Each rank then keeps its share of each MoE layer's experts, and the experts calls
            dispatch and combine over it (``autopipe.runtime.stage.expert_parallel``).

    Example:
        >>> def make_model():
        ...     return torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)])
        >>> b = build_stage(make_model, (torch.randn(2, 8),), {}, [0, 3, 6], pp_rank=1, pp_size=2)
        >>> [c.layer_range for c in b.chunks], sorted(b.params)[:2]  # rank 1 builds layers 3-5, and only them
        ([(3, 6)], ['3.bias', '3.weight'])
    """
    from ...graph.flattener import flatten

    import contextlib

    from ...graph.expert_calls import experts_as_calls

    model = meta_model(model_fn)
    # traced for this rank's device type: Python branching on it runs the branch this rank will;
    # under expert parallelism each experts call stays one op, which the ep runtime runs
    # (under tp too: tp runs them whole on each rank's local tensors, the rest of their block on DTensors)
    tp_on = tp_mesh is not None and tp_mesh.size() > 1
    as_calls = ep_group is not None or tp_on

    def trace(model: nn.Module, stack_traces: bool = False) -> tuple[Any, dict]:
        with experts_as_calls(model) if as_calls else contextlib.nullcontext({}) as experts:
            seq = flatten(model, to_meta(tuple(example_args)), to_meta(dict(example_kwargs or {})), validate=False,  # type: ignore[arg-type]
                          granularity=granularity, device_type=torch.device(device).type, autocast=autocast,
                          stack_traces=stack_traces)
        return seq, experts

    seq, experts = trace(model)
    # traced without source lines (16-30 % of the trace): a rank failing in a layer traces again for its line
    retrace_with_sources_(seq, lambda: trace(meta_model(model_fn), stack_traces=True)[0])
    ep_layout = None
    if ep_group is not None:
        import torch.distributed as dist

        from .expert_parallel import plan_expert_parallel

        ep_layout = plan_expert_parallel(experts, dist.get_world_size(ep_group), ep_group)
    if isinstance(plan, int):  # a chunk count: cut evenly (no plan yet)
        plan = StagePlan.even(len(seq.layers), plan)
    elif isinstance(plan, Plan):  # the partition pass's whole record: what the runtime reads of it
        plan = plan.stage_plan()
    elif not isinstance(plan, StagePlan):
        plan = StagePlan(tuple(plan))
    placed = plan.placed(pp_size, schedule)
    if placed.num_layers != len(seq.layers):
        traced = plan.trace_device or seq.trace_device
        if traced != seq.trace_device:
            raise AutopipeError(
                f"the plan was traced for {traced} and cuts {placed.num_layers} layers, but on {seq.trace_device} "
                f"this model flattens into {len(seq.layers)} (its forward branches on the device type): convert it "
                f"again for {seq.trace_device} (--device {seq.trace_device})."
            )
        raise AutopipeError(
            f"the plan cuts {placed.num_layers} layers but this model flattens into {len(seq.layers)}; "
            "the plan was made for another model or flatten options: partition again."
        )
    tp_layout = None
    if tp_mesh is not None and tp_mesh.size() > 1:  # decided on the meta model, alike on every rank
        from .tensor_parallel import plan_tensor_parallel

        tp_layout = plan_tensor_parallel(seq, model, tp_mesh.size(), tp_mesh, sequence_parallel=sequence_parallel,
                                         expert_parallel=ep_layout is not None)
    modes = chunk_modes(recompute, placed.num_chunks, placed.recompute)
    chunk_ids = placed.chunks_of(pp_rank)
    needed: list[str] = []
    for c in chunk_ids:
        for i in placed.layers_of(c):
            layer = seq.layers[i]
            needed += [n for n, _ in layer.named_parameters(remove_duplicate=False)]
            # the model's buffers; constants made in forward are the layer's own
            needed += [n for n, _ in layer.named_buffers(remove_duplicate=False)
                       if layer.autopipe_attrs.get(n) != "constant"]
    fill_tensors(model, model_fn, needed, seed=seed, weights=weights, device=device)
    seq.rebind_(model)
    for c in chunk_ids:
        for i in placed.layers_of(c):
            # Traced on meta: point the graphs' device constants at the real device.
            retarget_device_(seq.layers[i], device)
    chunks = [
        PipeChunk(
            [seq.layers[i] for i in placed.layers_of(c)],
            c,
            (placed.boundaries[c], placed.boundaries[c + 1]),
            recompute=modes[c],
        )
        for c in chunk_ids
    ]
    # a tied tensor goes by its group's canonical name on every rank, whichever alias a layer uses
    canonical = {}
    for g in seq.tied:
        for alias in g.names:
            try:
                canonical[id(model.get_parameter(alias))] = g.canonical
            except AttributeError:
                pass
    params: dict[str, nn.Parameter] = {}
    seen: set[int] = set()
    for chunk in chunks:
        for layer in chunk.layers:
            for name, p in layer.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params[canonical.get(id(p), name)] = p
    tied = [
        TiedSpec(g.canonical, tuple(g.names), tuple(placed.ranks_holding(g.layers)))
        for g in seq.tied
    ]
    aliases = _alias_local_copies(chunks, params, {t.name for t in tied})
    build = StageBuild(
        seq=seq,
        model=model,
        plan=placed,
        pp_rank=pp_rank,
        chunk_ids=chunk_ids,
        chunks=chunks,
        params=dict(sorted(params.items())),
        tied=tied,
        aliases=aliases,
        recompute=modes,
        model_fn=model_fn,
        seed=seed,
        weights=weights,
        tp_layout=tp_layout,
    )
    whole = dict(build.params)
    if tp_layout is not None:
        from .tensor_parallel import apply_tensor_parallel_

        apply_tensor_parallel_(build, tp_layout, tp_mesh)
        build.params = dict(sorted(build.params.items()))
    if ep_layout is not None:
        from .expert_parallel import apply_expert_parallel_

        apply_expert_parallel_(build, ep_layout)
    repoint_model_(build, whole)  # once, after both: each name's first tensor -> the one the rank now trains
    return build


def repoint_model_(build: StageBuild, before: Mapping[str, nn.Parameter]) -> None:
    """Point ``build.model`` at the stage's parameters where a pass replaced them (``before``: the
    parameters by name as they were): tp's DTensors, ep's expert slices, ZeRO 2/3's shards.

    The layers are graphs over their own module objects, so a pass that swaps a layer's parameters
    leaves the model's modules (which the flattener traced, and the reference reads) holding the old,
    whole ones. Kept there, every tp or ZeRO 2/3 rank held its whole stage's weights beside its shards
    for the whole run, a GPU's memory too; a CPU rank's memory baseline counted them, so no measured
    peak showed it (tests/test_zero.py, bench/results/held-weights.md). Under ep the experts modules
    (which the traced experts calls run) held every expert until each call's first forward swapped its
    slices in: a GPU rank's first step peaked with all of them, and CPU peaks read 0.85x the plan after
    the baseline had counted them (tests/test_expert_parallel.py, bench/results/moe-ep-memory.md).
    """
    swap = {id(p): build.params[n] for n, p in before.items() if n in build.params and build.params[n] is not p}
    if not swap:
        return
    for mod in build.model.modules():
        for attr, p in list(mod._parameters.items()):
            if p is not None and id(p) in swap:
                mod._parameters[attr] = swap[id(p)]


def build_reference(
    model_fn: ModelFn, *, seed: int = 0, weights: str | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """The whole model with exactly the weights the pipelined ranks build (for --verify and tests)."""
    model = meta_model(model_fn)
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    names += [n for n, _ in model.named_buffers(remove_duplicate=False)]
    fill_tensors(model, model_fn, names, seed=seed, weights=weights, device=device)
    return model


def fill_tensors(
    model: nn.Module,
    model_fn: ModelFn,
    names: Sequence[str],
    *,
    seed: int,
    weights: str | None,
    device: torch.device | str,
) -> None:
    new = materialize_(model, names, device=device)
    if weights is not None:
        missing = load_weights_(model, new, SafetensorsSource(weights))
        by_name = tensor_names(model)
        left = [t for t in new if by_name[id(t)][0] in set(missing)]
        missing = init_weights_(model, left, seed=seed) if left else []
    else:
        missing = init_weights_(model, new, seed=seed)
    if missing:
        _fill_from_constructor(model, model_fn, missing, seed=seed)


@torch.no_grad()
def _fill_from_constructor(model: nn.Module, model_fn: ModelFn, names: list[str], *, seed: int) -> None:
    """Tensors no per-module init covers take the value the model's constructor gives them.

    Buffers (masks, tables made in ``__init__``) come from a build whose parameters stay on meta,
    which is cheap. Parameters without an init function force a whole build on the CPU, seeded with
    ``seed``: correct on every layout, but it costs the whole model's memory once, so we warn.
    """
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    want_params = [n for n in names if n in params]
    if want_params:
        warnings.warn(
            f"parameters {want_params[:3]}{'...' if len(want_params) > 3 else ''} have no init "
            "function (no reset_parameters, no HF _init_weights); building the whole model once on "
            "the CPU to take their initial values. Give their modules a reset_parameters() to avoid it.",
            stacklevel=3,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            source = model_fn()
    else:
        with torch.random.fork_rng(devices=[]), params_on_meta():
            torch.manual_seed(seed)
            source = model_fn()
    for name in names:
        *path, attr = name.split(".")
        src_mod = source.get_submodule(".".join(path)) if path else source
        dst_mod = model.get_submodule(".".join(path)) if path else model
        value = src_mod._parameters.get(attr)
        if value is None:
            value = src_mod._buffers.get(attr)
        target = dst_mod._parameters.get(attr)
        if target is None:
            target = dst_mod._buffers.get(attr)
        if value is None or target is None or value.device.type == "meta":
            raise AutopipeError(f"could not find an initial value for {name!r} in the model.")
        target.copy_(value)


def _alias_local_copies(
    chunks: list[PipeChunk], params: dict[str, nn.Parameter], tied_names: set[str]
) -> dict[str, list[nn.Parameter]]:
    """Give each further local chunk that uses a tied tensor its own leaf over the same storage.

    Two chunks of one rank (interleaved, V schedules) sharing one Parameter object confuse the
    zero-bubble schedules' split backward, which tracks weights per stage; the gradients came out
    wrong (ZBV on GPT-2). With one leaf per chunk each stage's autograd graph is its own; the
    optimizer updates the first leaf in place and the aliases see it, since they share storage.
    """
    aliases: dict[str, list[nn.Parameter]] = {}
    for name in sorted(tied_names & set(params)):
        main = params[name]
        users = [c for c in chunks if any(p is main for p in c.parameters())]
        for chunk in users[1:]:
            leaf = nn.Parameter(main.data, requires_grad=main.requires_grad)
            for mod in chunk.modules():
                for attr, p in list(mod._parameters.items()):
                    if p is main:
                        mod._parameters[attr] = leaf
            aliases.setdefault(name, []).append(leaf)
    return aliases


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (a view of its storage), else ``t``."""
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t
