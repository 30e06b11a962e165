"""LayerSequence: the flattened model, and the stage modules it splits into.

A layer takes one Tensor or a tuple of Tensors and returns one (DeepSpeed's convention). Layer 0
takes the model's inputs packed into a tuple (``pack_inputs``); the last layer returns the model's
tensor outputs, which ``unpack_outputs`` puts back into the model's own structure (tuple, dict,
HuggingFace ModelOutput).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..errors import (
    AutopipeError,
    InputMismatchError,
    PartitionError,
    StaleProfileError,
)

__all__ = ["TensorSig", "LayerInfo", "TiedGroup", "IOSpec", "LayerSequence", "Stage", "retarget_device_", "check_boundaries"]


@dataclass(frozen=True)
class TensorSig:
    """Shape and dtype of one value crossing a cut."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.name}:{self.dtype}[{','.join(map(str, self.shape))}]"

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class LayerInfo:
    """What a person (and the profiler) needs to know about one layer."""

    index: int
    name: str  # module path, e.g. "transformer.h.3", or the glue modules it holds
    kind: str  # class name of the block, or "glue"
    params: int  # parameter elements, tied ones included
    param_names: tuple[str, ...]  # original dotted names of the parameters it holds
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    tied: tuple[str, ...]  # canonical names of tied tensors it holds
    structure: str  # identical layers (same ops, shapes, dtypes) share this key
    # batch-free values it reads that no cut carries: made on its stage (autopipe.graph.batch_free)
    computed: tuple[TensorSig, ...] = ()


@dataclass(frozen=True)
class TiedGroup:
    """One tensor reached under several names or used by several layers, found by identity."""

    canonical: str
    names: tuple[str, ...]
    layers: tuple[int, ...]


@dataclass(frozen=True)
class IOSpec:
    """How the model's inputs become layer 0's tuple and the last tuple becomes its outputs."""

    in_spec: pytree.TreeSpec
    in_tensor_positions: tuple[int, ...]  # which flat input leaves are tensors (passed to layer 0)
    in_names: tuple[str, ...]  # names of those leaves
    in_shapes: tuple[tuple[int, ...], ...]
    kwarg_order: tuple[str, ...]
    out_spec: pytree.TreeSpec
    out_constants: tuple[tuple[int, Any], ...]  # (flat position, value) of non-tensor outputs
    out_count: int

    def pack(self, args: Sequence[Any], kwargs: dict[str, Any] | None) -> tuple[torch.Tensor, ...]:
        kwargs = dict(kwargs or {})
        ordered = {k: kwargs.pop(k) for k in self.kwarg_order if k in kwargs}
        ordered.update(kwargs)
        leaves, spec = pytree.tree_flatten((tuple(args), ordered))
        if spec != self.in_spec:
            raise InputMismatchError(
                f"inputs are structured as {_describe(spec)} but the sequence was traced with "
                f"{_describe(self.in_spec)}; pass the same positional and keyword arguments as the example."
            )
        out = []
        for pos, name, shape in zip(self.in_tensor_positions, self.in_names, self.in_shapes):
            value = leaves[pos]
            if not isinstance(value, torch.Tensor):
                raise InputMismatchError(f"input '{name}' must be a Tensor, got {type(value).__name__}.")
            if tuple(value.shape) != shape:
                rows = f" (a micro-batch of {shape[0]} rows: train.py --batch-size {shape[0]})" if shape else ""
                raise InputMismatchError(
                    f"input '{name}' has shape {tuple(value.shape)} but the sequence was traced with "
                    f"{shape}{rows}; pass inputs of that shape, or flatten with example inputs of this one."
                )
            out.append(value)
        return tuple(out)

    def unpack(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> Any:
        tensors = list(as_tuple(x))
        flat: list[Any] = []
        constants = dict(self.out_constants)
        for pos in range(self.out_count):
            flat.append(constants[pos] if pos in constants else tensors.pop(0))
        return pytree.tree_unflatten(flat, self.out_spec)


def _describe(spec: pytree.TreeSpec) -> str:
    try:
        (args_spec, kwargs_spec) = spec.children()
        return f"{args_spec.num_leaves} positional leaves and keywords {list(kwargs_spec.context)}"
    except (AttributeError, ValueError, TypeError):
        return str(spec)


def as_tuple(x: Any) -> tuple[Any, ...]:
    """Layers accept a bare Tensor where a one-element tuple is meant (DeepSpeed does the same)."""
    if isinstance(x, tuple):
        return x
    return tuple(x) if isinstance(x, list) else (x,)


class LayerSequence(nn.Module):
    """A model flattened into layers a pipeline engine can cut anywhere.

    Calling it runs the layers in order and returns what the model returns, with gradients flowing
    to the model's own parameters (the layers hold the same Parameter objects).

    Example:
        >>> import autopipe, torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> seq = autopipe.flatten(model, (torch.randn(3, 4),))
        >>> len(seq.layers), [s.__class__.__name__ for s in seq.split([0, 2, 3])]
        (3, ['Stage', 'Stage'])
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        infos: Sequence[LayerInfo],
        io: IOSpec,
        tied: Sequence[TiedGroup],
        signature: str,
        *,
        model_name: str = "",
        options: dict[str, Any] | None = None,
        notes: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.infos = list(infos)
        self.io = io
        self.tied = list(tied)
        self.signature = signature
        self.model_name = model_name
        self.options = dict(options or {})
        self.notes = list(notes)  # caveats found while tracing, e.g. custom autograd Functions
        # the device type the graph was traced for (its Python branches on x.device.type); set by flatten
        self.trace_device = "cpu"
        # per layer, the module call of the model's forward where it starts (path, call index); set by flatten
        self.layer_entries: list[tuple[str, int] | None] = [None] * len(self.layers)
        # what flatten did to the traced attention (autopipe.graph.attention.AttentionRewrites); set by flatten
        self.attention: Any = None

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.layers)

    def pack_inputs(self, args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, ...]:
        """The tuple layer 0 takes, from the model's own arguments."""
        return self.io.pack(args, kwargs)

    def unpack_outputs(self, x: torch.Tensor | tuple[torch.Tensor, ...]) -> Any:
        """The model's own output structure, from the last layer's tuple."""
        return self.io.unpack(x)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x: Any = self.pack_inputs(args, kwargs)
        for layer in self.layers:
            x = layer(x)
        return self.unpack_outputs(x)

    def split(self, boundaries: Sequence[int] | Any, *, unpack_outputs: bool = True) -> list["Stage"]:
        """Cut into stages at ``boundaries`` (S + 1 layer indices from 0 to L), or at ``plan.boundaries``.

        The first stage takes the model's inputs, each next one the tuple the previous returned;
        the last returns the model's outputs (or its flat tuple with ``unpack_outputs=False``).
        """
        plan_signature = getattr(boundaries, "signature", "")
        if hasattr(boundaries, "boundaries"):
            if plan_signature and self.signature and plan_signature != self.signature:
                raise StaleProfileError(
                    f"the plan was made for model signature {plan_signature[:12]} but this sequence is "
                    f"{self.signature[:12]}; profile and partition this model (with these flatten options) again."
                )
            boundaries = boundaries.boundaries
        cuts = check_boundaries(boundaries, len(self.layers))
        n = len(cuts) - 1
        return [
            Stage(
                self.layers[cuts[s] : cuts[s + 1]],
                self.io,
                index=s,
                first=s == 0,
                last=s == n - 1,
                layer_range=(cuts[s], cuts[s + 1]),
                unpack_outputs=unpack_outputs,
            )
            for s in range(n)
        ]

    def retarget_(self, device: str | torch.device) -> "LayerSequence":
        """Make the layers create their tensors on ``device`` (after tracing on meta); see rebind_."""
        retarget_device_(self, device)
        return self

    def rebind_(self, model: nn.Module) -> "LayerSequence":
        """Re-read every parameter and buffer the layers hold from ``model`` by original name.

        After materialising meta parameters in the original model (new tensor objects), this makes
        the layers hold the new ones; tied names resolve to one object again.
        """
        for layer in self.layers:
            for name, kind in getattr(layer, "autopipe_attrs", {}).items():
                if kind == "parameter":
                    _set_attr(layer, name, model.get_parameter(name), parameter=True)
                elif kind == "buffer":
                    _set_attr(layer, name, model.get_buffer(name), parameter=False)
        return self


def retarget_device_(module: nn.Module, device: str | torch.device, *, constants: bool = True) -> None:
    """Point the device constants baked into traced graphs (``arange(device=meta)``) at ``device``.

    A model traced on meta records ``meta`` in every op that creates a tensor; after its parameters
    are materialised elsewhere the graphs must create tensors there too. Lifted constant tensors
    move along (``constants=False`` leaves them where they are); traced on meta they have no data,
    which is an error.
    """
    target = torch.device(device)

    swapped = [0]

    def swap(value: Any) -> Any:
        if isinstance(value, torch.device) and value != target:
            swapped[0] += 1
            return target
        return value

    for sub in module.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        before = swapped[0]
        for node in sub.graph.nodes:
            seen = swapped[0]
            args = fx.node.map_aggregate(node.args, swap)
            kwargs = fx.node.map_aggregate(node.kwargs, swap)
            if swapped[0] != seen:
                node.args, node.kwargs = args, kwargs
        if swapped[0] != before:  # recompiling a graph is its code generated and exec'd again: only when it changed
            sub.recompile()
        for name, kind in getattr(sub, "autopipe_attrs", {}).items():
            if kind != "constant" or not constants:
                continue
            *path, leaf = name.split(".")
            owner = sub.get_submodule(".".join(path))
            value = owner._buffers[leaf]
            if value is not None and value.is_meta and target.type != "meta":
                raise AutopipeError(
                    f"a layer holds a constant tensor '{name}' created in forward, traced on meta so its "
                    "values are unknown; flatten on a real device (or build that tensor from a buffer)."
                )
            if value is not None:
                owner._buffers[leaf] = value.to(target)


def check_boundaries(boundaries: Sequence[int], num_layers: int) -> list[int]:
    """Validate S + 1 strictly increasing cut indices from 0 to ``num_layers``."""
    cuts = [int(b) for b in boundaries]
    if len(cuts) < 2:
        raise PartitionError(f"boundaries {cuts} need at least two entries: 0 and {num_layers}.")
    if cuts[0] != 0 or cuts[-1] != num_layers:
        raise PartitionError(
            f"boundaries {cuts} must start at 0 and end at {num_layers} (the number of layers)."
        )
    stages = len(cuts) - 1
    if stages > num_layers:
        raise PartitionError(
            f"{stages} stages asked for but the sequence has only {num_layers} layers; "
            f"use at most {num_layers} stages or flatten with granularity='leaf'."
        )
    for s in range(stages):
        if cuts[s + 1] <= cuts[s]:
            raise PartitionError(
                f"boundaries {cuts} give stage {s} no layers; each stage needs at least one "
                "(use strictly increasing boundaries)."
            )
    return cuts


def _set_attr(root: nn.Module, dotted: str, value: torch.Tensor, *, parameter: bool) -> None:
    *path, field = dotted.split(".")
    mod = root
    for part in path:
        mod = getattr(mod, part)
    if parameter:
        mod._parameters[field] = value  # type: ignore[assignment]
    else:
        mod._buffers[field] = value


class Stage(nn.Module):
    """Consecutive layers of a LayerSequence run as one pipeline stage.

    ``forward(*args)`` follows torch.distributed.pipelining: the first stage takes the model's own
    arguments, later stages take the previous stage's outputs unpacked as positional arguments.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        io: IOSpec,
        *,
        index: int,
        first: bool,
        last: bool,
        layer_range: tuple[int, int],
        unpack_outputs: bool = True,
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.io = io
        self.index = index
        self.first = first
        self.last = last
        self.layer_range = layer_range
        self.unpack = unpack_outputs

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x: Any
        if self.first:
            x = self.io.pack(args, kwargs)
        else:
            x = args[0] if len(args) == 1 else tuple(args)
        for layer in self.layers:
            x = layer(x)
        if self.last and self.unpack:
            return self.io.unpack(x)
        return x

    def retarget_(self, device: str | torch.device) -> "Stage":
        """Make this stage's layers create their tensors on ``device`` (after tracing on meta)."""
        retarget_device_(self, device)
        return self
