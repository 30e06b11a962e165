"""DeepSpeed's PipelineModule over the flattened layers, cut exactly where the plan cuts.

The layer format is already DeepSpeed's (a Tensor or tuple of Tensors in and out), so each layer
becomes a ``LayerSpec``. Tied tensors become ``TiedLayerSpec`` entries: a small holder module owns
the tied weight (so DeepSpeed all-reduces its gradient between the stages holding it) and its
forward appends the weight to the activations; the layer right after it takes the weight from
there. The holder always sits on its layer's stage, so the weight never crosses a cut.

DeepSpeed's ``partition_method`` knows only uniform / parameters / type:regex, none of which
reproduces a plan, so the module is built with explicit parts (autopipe.runtime.deepspeed_engine.parts, the same
wrapper ``autopipe export --to deepspeed`` hands to users of their own layers).

Each rank builds only its stage: DeepSpeed calls ``LayerSpec.build`` for the local layers only, and
our specs materialise their tensors from the meta model on demand (same seeded init as the torch
path, so both engines start from the same weights). ``autopipe.runtime.deepspeed_engine.trainer`` trains the module.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import AutopipeError
from ...graph.rng import draws_random
from ...graph.sequence import retarget_device_
from ..stage.build import contiguous_grads, fill_tensors, meta_model, retrace_with_sources_, to_meta
from .parts import planned_pipeline_module

__all__ = ["DSLayer", "LayerSource", "TiedHolder", "build_pipeline_module", "save_final_weights"]


class LayerSource:
    """The meta model and its flattened layers, materialised piece by piece as specs are built."""

    def __init__(self, model_fn: Any, example_args: Sequence[Any], example_kwargs: dict[str, Any], *, seed: int,
                 weights: str | None, device: torch.device, autocast: torch.dtype | None = None) -> None:
        from ...graph.flattener import flatten

        self.model_fn = model_fn
        self.model = meta_model(model_fn)
        # traced for this rank's device type and under its autocast, as build_stage traces
        def trace(model: nn.Module, stack_traces: bool = False) -> Any:
            return flatten(model, to_meta(tuple(example_args)), to_meta(dict(example_kwargs)), validate=False,
                           device_type=torch.device(device).type, autocast=autocast, stack_traces=stack_traces)

        self.seq = trace(self.model)
        # without source lines, as build_stage: a rank failing in a layer traces again for its line
        retrace_with_sources_(self.seq, lambda: trace(meta_model(model_fn), stack_traces=True))
        self.seed, self.weights, self.device = seed, weights, device
        self.built: list[DSLayer] = []

    def materialize(self, names: Sequence[str]) -> None:
        fill_tensors(self.model, self.model_fn, list(names), seed=self.seed, weights=self.weights, device=self.device)
        self.seq.rebind_(self.model)
        for layer in self.built:  # rebind_ re-registers the tied tensors the built layers gave away
            layer.detach_tied()

    def tied_of(self, index: int) -> list[str]:
        return [g.canonical for g in self.seq.tied if index in g.layers]


class TiedHolder(nn.Module):
    """Owns one tied tensor on a stage (DeepSpeed syncs ``.weight`` between its holders)."""

    def __init__(self, ctx: LayerSource, name: str) -> None:
        super().__init__()
        ctx.materialize([name])
        self.tied_name = name
        self.weight = ctx.model.get_parameter(name)


def _append_weight(holder: TiedHolder, x: Any) -> tuple[torch.Tensor, ...]:
    xs = x if isinstance(x, tuple) else (x,)
    return (*xs, holder.weight)


class DSLayer(nn.Module):
    """Layer ``index`` of the sequence, taking its tied weights from the end of its input tuple.

    Booleans cross cuts as uint8 (DeepSpeed's p2p casts only a trailing mask; gloo sends no bool);
    the layer's recorded input signature says which inputs to turn back into bool.
    """

    def __init__(self, ctx: LayerSource, index: int) -> None:
        super().__init__()
        layer = ctx.seq.layers[index]
        names = [n for n, _ in layer.named_parameters(remove_duplicate=False)]
        names += [n for n, _ in layer.named_buffers(remove_duplicate=False) if layer.autopipe_attrs.get(n) != "constant"]
        ctx.materialize(names)
        retarget_device_(layer, ctx.device)
        self.ctx, self.index, self.layer = ctx, index, layer
        self.num_tied = len(ctx.tied_of(index))
        self.slots: list[tuple[nn.Module, str]] = []
        self.detach_tied()
        ctx.built.append(self)
        self.bool_inputs = {i for i, sig in enumerate(ctx.seq.infos[index].inputs) if sig.dtype == "bool"}
        self.seeds: Any = None  # MicrobatchSeeds of the step, set by DeepSpeedTrainer.step
        self.draws = draws_random(layer)  # seeded only if it draws (autopipe.graph.rng.draws_random)
        self.microbatch = 0
        self.autocast_dtype: torch.dtype | None = None  # --dtype bf16: autocast over fp32 weights
        self.register_load_state_dict_pre_hook(_buffers_as_built)


    def detach_tied(self) -> None:
        """Remove the tied tensors from the layer's parameters (the TiedHolder owns them); remember
        where they sat, in the order their holders append them (sorted names)."""
        tied = sorted(self.ctx.tied_of(self.index))
        order = {id(self.ctx.model.get_parameter(n)): i for i, n in enumerate(tied)}
        found: list[tuple[int, nn.Module, str]] = []
        for mod in self.layer.modules():
            for attr, p in list(mod._parameters.items()):
                if p is not None and id(p) in order:
                    del mod._parameters[attr]
                    found.append((order[id(p)], mod, attr))
        if found:
            self.slots = [(m, a) for _, m, a in sorted(found, key=lambda t: t[0])]

    def forward(self, x: Any) -> Any:
        xs = list(x) if isinstance(x, tuple) else [x]
        weights = xs[len(xs) - self.num_tied :] if self.num_tied else []
        xs = xs[: len(xs) - self.num_tied]
        for (mod, attr), w in zip(self.slots, _expand(weights, self.slots)):
            mod.__dict__[attr] = w
        xs = [t.bool() if i in self.bool_inputs else t for i, t in enumerate(contiguous_grads(xs))]
        if self.seeds is not None:  # the torch engine's per-layer, per-micro-batch seeds (MicrobatchSeeds)
            if self.draws:
                torch.manual_seed(self.seeds.layer_seed(self.microbatch, self.index))
            self.microbatch += 1
        device_type = xs[0].device.type if xs else "cpu"
        with torch.autocast(device_type, dtype=self.autocast_dtype or torch.bfloat16, enabled=self.autocast_dtype is not None):
            out = self.layer(xs[0] if len(xs) == 1 else tuple(xs))
        outs = out if isinstance(out, tuple) else (out,)
        outs = tuple(t.to(torch.uint8) if t.dtype == torch.bool else t for t in outs)
        # DeepSpeed sends what a stage returns as it is: gloo refuses a non-contiguous (channels-last) tensor
        outs = tuple(t if t.is_contiguous() else t.contiguous() for t in outs)
        if torch.is_grad_enabled():
            # DeepSpeed backpropagates through every floating output a stage sends (a float mask made
            # from attention_mask, as BLOOM's alibi, needs no gradient and failed "element 0 of tensors
            # does not require grad"); as leaves they take the gradient the next stage sends back,
            # which goes nowhere. Values the batch does not change (rotary tables) are not sent at all.
            outs = tuple(t.detach().requires_grad_() if t.is_floating_point() and not t.requires_grad else t for t in outs)
        return outs[0] if len(outs) == 1 else outs


def _buffers_as_built(module: DSLayer, state: dict[str, Any], prefix: str, *_: Any) -> None:
    """Let DeepSpeed's strict load take a layer file whose model buffers sit elsewhere.

    Which layer holds a buffer the model never writes follows from the flatten: one written before
    batch-free values were made on each stage has Llama's ``inv_freq`` in layer 0 (which now reads
    none) and not in the blocks (which now make their rotary tables from it). Such a buffer holds
    what the model was built with, so a file's extra copy is dropped and a missing one keeps the
    built value; parameters stay strict."""
    inner = prefix + "layer."
    model_buffers = {name for name, _ in module.ctx.model.named_buffers(remove_duplicate=False)}
    own = dict(module.layer.named_buffers())
    for key in [k for k in state if k.startswith(inner)]:
        name = key[len(inner):]
        if name in model_buffers and name not in own:
            del state[key]
    for name, value in own.items():
        if name in model_buffers and inner + name not in state:
            state[inner + name] = value


def _expand(weights: list[torch.Tensor], slots: list[tuple[nn.Module, str]]) -> list[torch.Tensor]:
    """One weight per tied tensor, repeated for each slot (a tensor may sit in several modules)."""
    if len(weights) == len(slots):
        return weights
    if len(weights) == 1:
        return weights * len(slots)
    raise AutopipeError("a layer holds several tied tensors in several places; DeepSpeed export needs one slot each.")


def build_pipeline_module(ctx: LayerSource, boundaries: Sequence[int], num_stages: int, loss_fn: Any) -> nn.Module:
    """LayerSpecs over the flattened layers (TiedLayerSpecs before layers using a tied tensor),
    partitioned at ``boundaries`` (layer indices, mapped onto the expanded spec list)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs: list[Any] = []
    starts: list[int] = []
    for i in range(len(ctx.seq.layers)):
        starts.append(len(specs))
        for name in sorted(ctx.tied_of(i)):
            # ModuleDict keys may not hold dots
            specs.append(TiedLayerSpec(name.replace(".", "__"), TiedHolder, ctx, name, forward_fn=_append_weight, tied_weight_attr=["weight"]))
        specs.append(LayerSpec(DSLayer, ctx, i))
    starts.append(len(specs))
    parts = [starts[b] for b in boundaries]
    return planned_pipeline_module(specs, parts, num_stages=num_stages, loss_fn=loss_fn)


def save_final_weights(module: nn.Module, folder: Path, stage: int, *, write: bool, meta: dict[str, Any] | None = None) -> None:
    """This stage's trained parameters under their names in the original model, as an autopipe
    checkpoint folder (``rank{stage}.pt`` + ``meta.json``) that ``export`` joins into one
    safetensors file. ``write``: only the first data-parallel replica's ranks write (replicas hold
    the same weights)."""
    params: dict[str, torch.Tensor] = {}
    for child in module.modules():
        if isinstance(child, DSLayer):
            for name, p in child.layer.named_parameters():
                params[name] = p.detach().clone()
    for holder in getattr(module, "tied_modules", {}).values():
        params[holder.tied_name] = holder.weight.detach().clone()
    if write:
        from ..checkpoints.exports import write_stage_weights

        write_stage_weights(folder, stage, params, meta)
