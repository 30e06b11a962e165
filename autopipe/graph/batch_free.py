"""Values that do not depend on the batch: made on each stage that uses them, never sent across a cut.

A traced HuggingFace decoder makes its causal mask and its rotary cos/sin in the first layer, from
``arange``, comparisons and the ``inv_freq`` buffer alone, and every block reads them. Carried as
layer outputs they would cross every cut of the pipeline, each micro-batch (and DeepSpeed sends a
gradient back for each floating one). torchtitan and Megatron users make such tables on every
stage; so does autopipe.

A node is *batch-free* (:func:`batch_free_nodes`) when its value is a function of constants alone:
lifted constant tensors, non-tensor inputs baked into the trace, and buffers the model never writes;
through operators that are deterministic (no ``rand``, ``dropout``, ``bernoulli``), have no side
effect and write into nothing, and whose value no later in-place operator changes. Parameters and
the user's tensor inputs never are.

Such a value used by a later layer than the one that makes it is *folded*: every layer using it
calls one shared :class:`BatchFreeValue`, which runs the value's recipe (a small GraphModule of
the nodes it needs; the buffers it reads are passed in by the layer, which holds them under their
original names as it holds any buffer) and keeps the result for reuse, for every layer of the stage
and every micro-batch, until a buffer it read or the autocast state it ran under changes.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn

__all__ = ["BatchFreeValue", "batch_free_nodes", "computed_in_layer", "crossing_values", "held_tensors", "making_value",
           "recipe"]

# Arguments the eval-mode switch (autopipe.runtime.stage.eval_mode) rewrites: a value made with them in
# train mode would be wrong in eval mode, so an operator taking one is never batch-free.
_MODE_ARGUMENTS = {"train", "training", "dropout_p"}


def batch_free_nodes(gm: fx.GraphModule, sources: Iterable[fx.Node]) -> set[fx.Node]:
    """The nodes of ``gm`` whose value does not depend on the batch (module docstring).

    ``sources`` are the placeholders that are constants: lifted constant tensors, non-tensor user
    inputs baked in, buffers no BUFFER_MUTATION writes. Every other placeholder (parameters, tensor
    inputs, written buffers) depends on the batch or on training.
    """
    free: set[fx.Node] = set(sources)
    tainted = _written(gm)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            # a subgraph of a higher-order op: not a value; the op using it is judged by _pure
            if isinstance(_attr(gm, node.target), fx.GraphModule):
                free.add(node)
        elif node.op == "call_function" and node not in tainted and _pure(gm, node):
            if all(a in free for a in node.all_input_nodes):
                free.add(node)
    return free


def crossing_values(
    gm: fx.GraphModule,
    sources: Iterable[fx.Node],
    layers: Sequence[Sequence[fx.Node]],
    layer_of: Mapping[fx.Node, int],
    outputs: Iterable[fx.Node],
    is_tensor: Callable[[fx.Node], bool],
) -> tuple[set[fx.Node], set[fx.Node]]:
    """(every batch-free node, the batch-free tensors some layer other than their maker reads: the
    values to fold). ``layers`` holds each layer's nodes; the last layer returns ``outputs``."""
    free = batch_free_nodes(gm, sources)
    readers: dict[fx.Node, set[int]] = {}
    for i, nodes in enumerate(layers):
        for n in nodes:
            for a in n.all_input_nodes:
                readers.setdefault(a, set()).add(i)
    for v in outputs:
        readers.setdefault(v, set()).add(len(layers) - 1)
    folded = {v for v in free if v.op == "call_function" and v in layer_of and is_tensor(v)
              and readers.get(v, set()) - {layer_of[v]}}
    return free, folded


def _pure(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Deterministic, no side effect, writes nothing: running it again gives the same value."""
    target = node.target
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.HigherOrderOperator):
        # wrap_with_set_grad_enabled / wrap_with_autocast: a region whose ops are judged one by one
        if target.__name__ not in ("wrap_with_set_grad_enabled", "wrap_with_autocast"):
            return False
        subgraphs = [_attr(gm, a.target) for a in node.all_input_nodes if a.op == "get_attr"]
        return all(isinstance(s, fx.GraphModule) and _pure_graph(s) for s in subgraphs)
    if not isinstance(target, torch._ops.OpOverload):
        return False  # a Python callable of the trace (grad-mode switches, assertions): keep it in place
    schema = target._schema
    if torch.Tag.nondeterministic_seeded in target.tags or schema.is_mutable:
        return False
    if any(a.name in _MODE_ARGUMENTS for a in schema.arguments):
        return False
    return not node.is_impure()


def _pure_graph(gm: fx.GraphModule) -> bool:
    return all(n.op in ("placeholder", "output", "get_attr") or (n.op == "call_function" and _pure(gm, n))
               for n in gm.graph.nodes)


def _attr(gm: fx.GraphModule, target: str) -> Any:
    owner: Any = gm
    for part in target.split("."):
        owner = getattr(owner, part, None)
    return owner


def _written(gm: fx.GraphModule) -> set[fx.Node]:
    """Every node whose storage some in-place operator writes, with all nodes that may alias it.

    A value another operator writes into later has two values in the graph's order; its users could
    read either, so none of it is folded. Aliases are followed both ways (a view of a written tensor,
    the tensor a written view came from): ops whose result may alias an argument (views, ``reshape``,
    ``to``) and ``getitem`` join their argument's group.
    """
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent.get(n, n) is not n:
            n = parent[n]
        return n

    def union(a: fx.Node, b: fx.Node) -> None:
        parent[find(a)] = find(b)

    written: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            union(node, node.args[0])
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        aliased = any(r.alias_info is not None for r in schema.returns)
        for i, arg in enumerate(schema.arguments):
            given = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for value in given if isinstance(given, (list, tuple)) else [given]:
                if not isinstance(value, fx.Node) or arg.alias_info is None:
                    continue
                if arg.alias_info.is_write:
                    written.append(value)
                if aliased:
                    union(node, value)
    roots = {find(n) for n in written}
    return {n for n in gm.graph.nodes if find(n) in roots}


def recipe(value: fx.Node, constants: Mapping[fx.Node, Any]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The nodes ``value`` is made from, as a GraphModule taking the tensors it reads (buffers and
    lifted constants: the returned placeholders of the traced graph, in graph order); non-tensor
    inputs baked into the trace (``constants``) are written in."""
    gm = value.graph.owning_module
    needed: set[fx.Node] = set()
    todo = [value]
    while todo:
        n = todo.pop()
        if n in needed:
            continue
        needed.add(n)
        if n.op != "placeholder":
            todo.extend(n.all_input_nodes)
    g = fx.Graph()
    env: dict[fx.Node, Any] = {}
    inputs = [n for n in value.graph.nodes if n in needed and n.op == "placeholder" and n not in constants]
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    subgraphs: dict[str, Any] = {}
    for n in value.graph.nodes:
        if n not in needed or n.op == "placeholder":
            continue
        if n.op == "get_attr":
            subgraphs[n.target] = _attr(gm, n.target)
            env[n] = g.get_attr(n.target)
        else:
            env[n] = g.node_copy(n, lambda a: constants[a] if a in constants else env[a])
        env[n].meta = dict(n.meta)
    g.output(env[value])
    g.lint()
    return fx.GraphModule(subgraphs, g, class_name="BatchFreeRecipe"), inputs


class BatchFreeValue(nn.Module):
    """One batch-free value, made on the stage that uses it and kept: ``holder(*tensors_it_reads)``.

    Every layer using the value calls the same holder, so a stage keeps one copy whatever number of
    its layers read it. The value is made again when the tensors passed in change (another object,
    device, storage, or an in-place write: ``_version``), when the recipe's graph is recompiled
    (``retarget_device_`` after materialising a meta model) or when the autocast state it runs
    under changes. It never requires grad.

    Not kept: a value made on meta or fake tensors, or while something traces (FakeTensorMode,
    make_fx, torch.compile): the profiler's estimate mode and shape passes run layers that way, and a
    kept meta value would be handed out after the real tensors arrive. Outside tracing the recipe runs
    unseen by Python dispatch modes (torch's selective-checkpoint caches, the profiler's counters),
    so a layer's forward and its recomputation see the same operators whether or not the value was
    kept. The kept value is no buffer: it is not in ``state_dict``, a checkpoint, or a module copy.

    Example:
        >>> import torch, autopipe
        >>> from autopipe.graph.batch_free import held_tensors
        >>> class Net(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         scale = torch.arange(4.0) / 4  # made from constants: the batch does not change it
        ...         return self.b(self.a(x) * scale) * scale
        >>> seq = autopipe.flatten(Net(), (torch.randn(2, 4),))
        >>> [str(s) for s in seq.infos[1].inputs], [str(s) for s in seq.infos[1].computed]
        (['linear:float32[2,4]'], ['div:float32[4]'])
        >>> _ = seq(torch.randn(2, 4))
        >>> [tuple(t.shape) for t in held_tensors(seq)]  # one copy, shared by both layers
        [(4,)]
    """

    def __init__(self, graph: fx.GraphModule, name: str) -> None:
        super().__init__()
        self.recipe = graph
        self.value_name = name  # the traced node it stands for
        self._value: Tensor | None = None
        self._key: tuple[Any, ...] = ()
        self._last: Any = None  # a weak reference to the last value made and not kept

    def forward(self, *inputs: Tensor) -> Tensor:
        if _tracing(inputs):
            with torch.no_grad(), _making():
                value = self.recipe(*inputs)
            self._last = weakref.ref(value)
            return value
        if self._value is not None and self._fresh(inputs):
            return self._value
        with torch._C._DisableTorchDispatch(), torch.inference_mode(False), torch.no_grad():
            value = self.recipe(*inputs)
        if value.is_meta:  # the recipe still makes its tensors on meta (a layer not retargeted yet)
            self._last = weakref.ref(value)
            return value
        self._value = value
        self._key = self._state(inputs, value.device.type)
        return value

    def _state(self, inputs: tuple[Tensor, ...], device_type: str) -> tuple[Any, ...]:
        tensors = tuple((weakref.ref(t), t._version, t.data_ptr(), t.device) for t in inputs)
        amp = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return tensors, self.recipe.code, amp

    def _fresh(self, inputs: tuple[Tensor, ...]) -> bool:
        assert self._value is not None
        tensors, code, amp = self._key
        device_type = self._value.device.type
        if code != self.recipe.code or len(tensors) != len(inputs):
            return False
        if amp != (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)):
            return False
        return all(ref() is t and version == t._version and ptr == t.data_ptr() and device == t.device
                   for (ref, version, ptr, device), t in zip(tensors, inputs))

    def held(self) -> list[Tensor]:
        """The value kept, and the last one made without keeping while still alive."""
        last = self._last() if self._last is not None else None
        return [t for t in (self._value, last) if t is not None]

    def __getstate__(self) -> dict[str, Any]:
        # a copy (deepcopy, pickle) makes its own value: the one kept here may be on another device
        state = dict(self.__dict__)
        state.update(_value=None, _key=(), _last=None)
        return state

    def extra_repr(self) -> str:
        return f"value={self.value_name}"


def held_tensors(module: nn.Module) -> list[Tensor]:
    """The batch-free values the holders in ``module`` keep (each holder once)."""
    out: list[Tensor] = []
    for m in module.modules():
        if isinstance(m, BatchFreeValue):
            out += m.held()
    return out


_STATE = threading.local()


@contextlib.contextmanager
def _making() -> Iterator[None]:
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def making_value() -> bool:
    """Whether a holder is making a value it cannot keep (on meta or fake tensors: the profiler's
    estimate mode). A stage makes each value once, not per micro-batch, so the profiler's operator
    and memory counters leave these operators out; a real value is made unseen by them anyway."""
    return getattr(_STATE, "depth", 0) > 0


def _tracing(inputs: tuple[Tensor, ...]) -> bool:
    """Whether the values made now are no real values to keep: fake or meta tensors, or a tracer."""
    if torch.compiler.is_compiling():
        return True
    modes = torch._C._TorchDispatchModeKey
    if any(torch._C._get_dispatch_mode(k) is not None for k in (modes.FAKE, modes.PROXY, modes.FUNCTIONAL)):
        return True
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if get_proxy_mode() is not None:  # make_fx and export's pre-dispatch tracing
        return True
    return any(type(t) is not torch.Tensor or t.is_meta for t in inputs)


def computed_in_layer(nodes: Iterable[fx.Node], free: set[fx.Node], folded: set[fx.Node],
                      kept: Iterable[fx.Node]) -> set[fx.Node]:
    """The batch-free nodes among ``nodes`` (one layer's) that the layer still computes itself: what
    its batch-dependent nodes or ``kept`` (its outputs, its buffer writes) read, and what those are
    made from. A folded value comes from its holder, so what only it needed is left out."""
    mine = set(nodes)
    todo = [a for n in mine if n not in free for a in n.all_input_nodes] + list(kept)
    need: set[fx.Node] = set()
    while todo:
        a = todo.pop()
        if a in need or a not in mine or a not in free or a in folded:
            continue
        need.add(a)
        todo.extend(a.all_input_nodes)
    return need
