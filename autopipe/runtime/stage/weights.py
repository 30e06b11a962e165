"""Give real values to some of a meta model's tensors: load them from safetensors or initialise them.

Initialisation must not depend on which tensors a rank holds, or a 2-stage run, a 4-stage run and
the unpipelined reference would start from different weights. So each module is initialised on its
own, with the global RNG seeded from ``(seed, module name)``, by the model's own init function:
``PreTrainedModel._init_weights`` for HuggingFace models (the same calls, in the same children-first
order, as ``model.post_init()`` makes), else the module's ``reset_parameters()``. A module whose
subtree holds a wanted tensor is initialised; other modules stay on meta and cost nothing.

Tensors are identified by object, not by name: GPT-2's ``lm_head.weight`` *is*
``transformer.wte.weight``, so materialising it once rebinds both names and ties stay ties.

Initialisation runs on the CPU whatever device the tensors live on (``host_init``): a GPU's
init would draw from that GPU's generator, whose numbers differ from the CPU's for the same seed,
so a job would start from other weights on a GPU than on a CPU (and than its CPU reference).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from ...errors import AutopipeError, ModelNotFoundError

__all__ = [
    "SafetensorsSource",
    "host_init",
    "init_weights_",
    "load_weights_",
    "materialize_",
    "module_seed",
    "tensor_names",
]


def module_seed(seed: int, name: str) -> int:
    """A 63-bit seed from the run's seed and a module name, the same on every machine."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def tensor_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter/buffer object is reachable by: id(tensor) -> names, in model order."""
    names: dict[int, list[str]] = defaultdict(list)
    for mname, mod in model.named_modules(remove_duplicate=False):
        for table in (mod._parameters, mod._buffers):
            for attr, t in table.items():
                if t is not None:
                    full = f"{mname}.{attr}" if mname else attr
                    if full not in names[id(t)]:
                        names[id(t)].append(full)
    return names


def _slots(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, bool]]]:
    """id(tensor) -> every (module, attribute, is_parameter) that holds it."""
    slots: dict[int, list[tuple[nn.Module, str, bool]]] = defaultdict(list)
    seen_mods: set[int] = set()
    for _, mod in model.named_modules(remove_duplicate=False):
        if id(mod) in seen_mods:
            continue
        seen_mods.add(id(mod))
        for attr, p in mod._parameters.items():
            if p is not None:
                slots[id(p)].append((mod, attr, True))
        for attr, b in mod._buffers.items():
            if b is not None:
                slots[id(b)].append((mod, attr, False))
    return slots


def _lookup(model: nn.Module, name: str) -> torch.Tensor:
    *path, attr = name.split(".")
    mod = model.get_submodule(".".join(path)) if path else model
    t = mod._parameters.get(attr)
    if t is None:
        t = mod._buffers.get(attr)
    if t is None:
        raise AutopipeError(f"the model has no parameter or buffer named {name!r}.")
    return t


def materialize_(
    model: nn.Module,
    names: Iterable[str],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = torch.float32,
) -> list[torch.Tensor]:
    """Replace the meta tensors reachable by ``names`` with uninitialised real ones, in place.

    Floating tensors get ``dtype`` (fp32 master weights under mixed precision); others keep theirs.
    Returns the new tensors (each once, tied ones included once).
    """
    slots = _slots(model)
    out: list[torch.Tensor] = []
    done: set[int] = set()
    for name in names:
        old = _lookup(model, name)
        if id(old) in done or old.device.type != "meta":
            continue
        done.add(id(old))
        want = dtype if (dtype is not None and old.is_floating_point()) else old.dtype
        data = torch.empty(old.shape, dtype=want, device=device)
        is_param = isinstance(old, nn.Parameter)
        new = nn.Parameter(data, requires_grad=old.requires_grad) if is_param else data
        for mod, attr, as_param in slots[id(old)]:
            (mod._parameters if as_param else mod._buffers)[attr] = new
        out.append(new)
    return out


def _post_order(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """Modules children-first, as ``nn.Module.apply`` (and HF's ``smart_apply``) visit them."""

    def walk(prefix: str, mod: nn.Module, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
        for name, child in mod._modules.items():
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            yield from walk(f"{prefix}.{name}" if prefix else name, child, seen)
        yield prefix, mod

    yield from walk("", model, set())


def _init_fn(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    """The model's own per-module init: HF ``_init_weights`` of the nearest PreTrainedModel, else
    ``reset_parameters``. Returns False for a module with neither."""
    owners: dict[int, nn.Module] = {}
    try:
        from transformers import PreTrainedModel
    except ImportError:  # transformers is a dependency, but keep plain models independent of it
        PreTrainedModel = ()  # type: ignore[assignment]

    def mark(mod: nn.Module, owner: nn.Module | None) -> None:
        if isinstance(mod, PreTrainedModel):  # type: ignore[arg-type]
            owner = mod
        if owner is not None:
            owners[id(mod)] = owner
        for child in mod.children():
            mark(child, owner)

    mark(model, None)

    def init(name: str, mod: nn.Module) -> bool:
        owner = owners.get(id(mod))
        if owner is not None:
            owner._init_weights(mod)  # type: ignore[operator]
            return True
        reset = getattr(mod, "reset_parameters", None)
        if callable(reset) and (mod._parameters or mod._buffers):
            reset()
            return True
        private = _torch_private_init(mod)
        if private is not None:
            private()
            return True
        return False

    return init


def _torch_private_init(mod: nn.Module) -> Callable[[], None] | None:
    """The init of a torch module that names it ``_reset_parameters`` (``nn.MultiheadAttention``, the
    ``nn.Transformer`` family), as its constructor calls it; None for any other module.

    It also writes a child's tensor (MultiheadAttention zeroes ``out_proj.bias``), which the
    constructor did too; ``_writes_only`` still keeps every tensor of the module that was not asked for.
    """
    fn = getattr(mod, "_reset_parameters", None)
    if callable(fn) and type(mod).__module__.startswith("torch.nn.modules") and mod._parameters:
        return fn
    return None


@torch.no_grad()
def init_weights_(model: nn.Module, tensors: Iterable[torch.Tensor], *, seed: int) -> list[str]:
    """Initialise ``tensors`` (already materialised in ``model``) with the model's own init.

    Every module whose subtree holds one of them is initialised, children first, each with the RNG
    seeded from ``(seed, module name)``; the global RNG state is restored afterwards. Returns the
    names of tensors no init function wrote (found by filling them with NaN first; integer buffers
    always count as not written), for the caller to fill another way.
    """
    wanted = {id(t): t for t in tensors}
    if not wanted:
        return []
    for t in wanted.values():
        if t.is_floating_point():
            t.fill_(float("nan"))
    init = _init_fn(model)
    with torch.random.fork_rng(devices=[]), host_init(model, wanted.values()) as held:
        here = {id(t): t for t in held.values()}  # what the model holds meanwhile: a GPU tensor's CPU twin
        for name, mod in _post_order(model):
            if not any(id(t) in here for t in _subtree_tensors(mod)):
                continue
            torch.manual_seed(module_seed(seed, name))
            # the twins the model holds, not the GPU tensors they stand for; a torch module's private
            # init writes its children too (MultiheadAttention's out_proj.bias)
            with _writes_only(mod, here, subtree=_torch_private_init(mod) is not None):
                init(name, mod)
    names = tensor_names(model)
    return [
        names[i][0]
        for i, t in wanted.items()
        if not t.is_floating_point() or bool(torch.isnan(t).any())
    ]


@contextlib.contextmanager
def _writes_only(mod: nn.Module, wanted: dict[int, torch.Tensor], *, subtree: bool = False) -> Iterator[None]:
    """Let a module's init function write only the wanted tensors, in place, as they are.

    An init function initialises every tensor of its module: run to fill a buffer the checkpoint
    lacks (Gemma's non-persistent ``embed_scale`` sits beside the embedding weight), it would
    overwrite the weight just loaded; its other real tensors are put back. It may also assign new
    tensors instead of writing (litgpt's ``reset_parameters`` makes new rotary tables): their
    values are copied into the tensors the layers hold, which go back into their slots.
    ``subtree``: the same for the tensors of every module below ``mod``.
    """
    modules = list(mod.modules()) if subtree else [mod]
    before = [(table, attr, t, None if id(t) in wanted or t.is_meta else t.detach().clone())
              for m in modules for table in (m._parameters, m._buffers) for attr, t in table.items() if t is not None]
    yield
    with torch.no_grad():
        for table, attr, t, saved in before:
            now = table.get(attr)
            if saved is not None:
                t.copy_(saved)
            elif now is not t and isinstance(now, torch.Tensor) and now.shape == t.shape and not now.is_meta:
                t.copy_(now)
            table[attr] = t


@contextlib.contextmanager
def host_init(model: nn.Module, tensors: Iterable[torch.Tensor]) -> Iterator[dict[int, torch.Tensor]]:
    """Inside, ``model`` holds a CPU twin of each of ``tensors`` on an accelerator (cuda, ...), in
    every place it holds the tensor (ties stay ties); after, the twin's values are in the tensor and
    the model holds the tensor again. What initialises the twins draws from the CPU generator, the
    same on every machine for a seed, where a GPU's generator gives other numbers. Yields
    ``id(tensor) -> what the model holds instead`` (the tensor itself where it stays).
    """
    slots = _slots(model)
    twins = []
    held: dict[int, torch.Tensor] = {}
    for t in dict.fromkeys(tensors):
        held[id(t)] = t
        if t.device.type in ("cpu", "meta"):
            continue
        data = t.detach().to("cpu")
        twin = nn.Parameter(data, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else data
        _rebind(slots[id(t)], twin)
        twins.append((t, twin))
        held[id(t)] = twin
    try:
        yield held
        with torch.no_grad():
            for t, twin in twins:
                t.copy_(twin)
    finally:
        for t, _ in twins:
            _rebind(slots[id(t)], t)


def _rebind(places: list[tuple[nn.Module, str, bool]], tensor: torch.Tensor) -> None:
    for mod, attr, is_param in places:
        (mod._parameters if is_param else mod._buffers)[attr] = tensor


def _subtree_tensors(mod: nn.Module) -> list[torch.Tensor]:
    return [*mod.parameters(), *mod.buffers()]


class SafetensorsSource:
    """Reads single tensors from a safetensors file, or an HF folder (sharded or not), lazily."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        self.files: dict[str, Path] = {}
        if p.is_file():
            files = [p]
        elif (p / "model.safetensors.index.json").is_file():
            index = json.loads((p / "model.safetensors.index.json").read_text())
            for key, shard in index["weight_map"].items():
                self.files[key] = p / shard
            files = []
        elif p.is_dir() and list(p.glob("*.safetensors")):
            files = sorted(p.glob("*.safetensors"))
        else:
            raise ModelNotFoundError(
                f"no safetensors weights at {str(p)!r}; give a .safetensors file or a folder with "
                "model.safetensors (or model.safetensors.index.json)."
            )
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                    self.files.setdefault(key, f)

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[key]), framework="pt") as h:
            return h.get_tensor(key)


@torch.no_grad()
def load_weights_(
    model: nn.Module, tensors: Iterable[torch.Tensor], source: SafetensorsSource
) -> list[str]:
    """Copy each tensor's value from ``source``, found under any of its names; only these keys
    are read. Returns the names of tensors the file lacks (non-persistent buffers, usually)."""
    names = tensor_names(model)
    missing = []
    for t in tensors:
        aliases = names[id(t)]
        key = next((n for n in aliases if n in source), None)
        if key is None:
            missing.append(aliases[0])
            continue
        value = source.get(key)
        if tuple(value.shape) != tuple(t.shape):
            raise AutopipeError(
                f"weight {key!r} has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(t.shape)} in the model; the weights belong to another model config."
            )
        t.copy_(value)
    return missing


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules whose parameters land on meta while buffers stay real (for buffers that no
    init function recomputes, such as masks registered in ``__init__``)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(
                param.detach().to("meta"), requires_grad=param.requires_grad
            )

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]
