"""Where models come from: a built-in name, a local HuggingFace folder, a Python factory, or torchtitan's
registry (``torchtitan:llama3:8B``, autopipe.graph.titan_models).

Nothing is downloaded: built-ins are HuggingFace configs with random initialisation.

    spec = load_model("gpt2", device="meta", batch_size=1, seq_len=128)
    spec.model, spec.args, spec.kwargs    # ready for autopipe.flatten

A factory (``package.module:function`` or ``path/to/file.py:function``) returns a model, or a tuple
``(model, example_args)`` / ``(model, example_args, example_kwargs)``, or a dict with the keys
``model``, ``args``, ``kwargs`` and optionally ``loss`` (``loss(outputs, target)``: the job trains
on it) and ``data`` (samples to train on: a dict of arrays ``{"x": ..., "y": ...}``, a map-style
``Dataset`` of ``(x, y)`` pairs, or a function returning one of those). If it returns only a model,
its module may define ``example_inputs(batch_size, seq_len)`` returning the args (or args, kwargs).
"""

from __future__ import annotations

import ast
import contextlib
import difflib
import importlib
import importlib.util
import inspect
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from ..errors import ModelNotFoundError
from .model_spec import ModelSpec
from .titan_models import is_titan_spec, load_titan, parse_titan_spec

__all__ = ["ModelSpec", "load_model", "BUILTINS", "builtin_names", "check_source"]


@dataclass(frozen=True)
class _Builtin:
    config: str  # transformers config class
    model: str  # transformers model class
    task: str
    settings: dict[str, Any]
    about: str


def _llama(h: int, layers: int, heads: int, kv: int, inter: int, vocab: int, about: str) -> _Builtin:
    return _Builtin(
        "LlamaConfig", "LlamaForCausalLM", "causal-lm",
        dict(hidden_size=h, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
             intermediate_size=inter, vocab_size=vocab, max_position_embeddings=4096),
        about,
    )


BUILTINS: dict[str, _Builtin] = {
    "gpt2": _Builtin("GPT2Config", "GPT2LMHeadModel", "causal-lm", {}, "GPT-2 124M"),
    "gpt2-medium": _Builtin("GPT2Config", "GPT2LMHeadModel", "causal-lm",
                            dict(n_embd=1024, n_layer=24, n_head=16), "GPT-2 355M"),
    "gpt2-large": _Builtin("GPT2Config", "GPT2LMHeadModel", "causal-lm",
                           dict(n_embd=1280, n_layer=36, n_head=20), "GPT-2 774M"),
    "gpt2-xl": _Builtin("GPT2Config", "GPT2LMHeadModel", "causal-lm",
                        dict(n_embd=1600, n_layer=48, n_head=25), "GPT-2 1.5B"),
    "llama-tiny": _llama(256, 4, 8, 4, 688, 32000, "Llama-shaped, 4 layers, hidden 256 (~20M)"),
    "llama-1b": _llama(2048, 16, 32, 8, 8192, 128256, "Llama-3.2-1B shape"),
    "llama-7b": _llama(4096, 32, 32, 32, 11008, 32000, "Llama-2-7B shape"),
    "llama-13b": _llama(5120, 40, 40, 40, 13824, 32000, "Llama-2-13B shape"),
    "llama-70b": _llama(8192, 80, 64, 8, 28672, 128256, "Llama-3-70B shape"),
    "bert-base": _Builtin("BertConfig", "BertForMaskedLM", "masked-lm", {}, "BERT base, masked LM"),
    "t5-small": _Builtin("T5Config", "T5ForConditionalGeneration", "seq2seq",
                         dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128,
                              decoder_start_token_id=0, pad_token_id=0), "T5 small"),
    "vit-base": _Builtin("ViTConfig", "ViTForImageClassification", "image-classification",
                         dict(num_labels=1000), "ViT-B/16, 224px"),
}


def builtin_names() -> list[str]:
    return list(BUILTINS)


def load_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    seq_len: int = 128,
    seed: int = 0,
    dropout: float | None = None,
    weights: bool = True,
) -> ModelSpec:
    """Build the model named by ``spec`` on ``device`` ("meta" allocates no weights) with example inputs.

    ``weights=False`` leaves a folder's safetensors unread (the training runtime reads each rank's
    tensors itself, by key).

    ``batch_size`` is the micro-batch: None takes the model's own (a factory's example inputs, 1 for
    built-ins and folders). A factory that takes ``batch_size`` is asked for it; one that does not
    keeps its example's rows, unless ``batch_size`` says otherwise: then every example tensor with
    the example's rows is cut or repeated to ``batch_size`` rows (``spec.batch_size`` says which).

    Example:
        >>> ms = load_model("llama-70b", device="meta", batch_size=1, seq_len=16)
        >>> ms.task, ms.args[0].shape
        ('causal-lm', torch.Size([1, 16]))
    """
    if (batch_size is not None and batch_size < 1) or seq_len < 1:
        raise ModelNotFoundError(f"batch size and sequence length must be >= 1 (got {batch_size}, {seq_len}).")
    device = torch.device(device)
    torch.manual_seed(seed)
    if spec in BUILTINS:
        return _from_builtin(spec, device, batch_size or 1, seq_len, dropout)
    path = Path(spec)
    if path.is_dir():
        return _from_folder(path, device, batch_size or 1, seq_len, dropout, weights)
    if is_titan_spec(spec):  # torchtitan:MODULE:FLAVOR, torchtitan's own registry (graph/titan_models.py)
        return load_titan(spec, device, batch_size or 1, seq_len, seed)
    if ":" in spec:
        return _from_factory(spec, device, batch_size, seq_len)
    raise ModelNotFoundError(
        f"unknown model {spec!r}: not a built-in name ({', '.join(BUILTINS)}), not a folder, "
        f"and not a factory 'module:function' or 'file.py:function'.{_did_you_mean(spec, list(BUILTINS))}"
    )


def check_source(spec: str) -> None:
    """Refuse, cheaply and before any work, a model that cannot be found: an unknown name, a factory
    file or module that does not exist, a function it lacks (each naming the closest match). A
    factory file is read, not run (its top-level names); a module is imported.

    Example:
        >>> try:
        ...     check_source("gtp2")
        ... except ModelNotFoundError as e:
        ...     print(str(e).split(". ")[-1])
        Did you mean gpt2?
    """
    if spec in BUILTINS or Path(spec).is_dir():
        return
    if is_titan_spec(spec):
        parse_titan_spec(spec)  # its shape; the registry is imported when it is built
        return
    if ":" not in spec:
        raise ModelNotFoundError(
            f"unknown model {spec!r}: not a built-in name ({', '.join(BUILTINS)}), not a folder, "
            f"and not a factory 'module:function' or 'file.py:function'.{_did_you_mean(spec, list(BUILTINS))}"
        )
    target, _, func_name = spec.rpartition(":")
    if not target.endswith(".py"):
        module = _import_target(target)  # imported once: load_model finds it in sys.modules
        names = [n for n, v in vars(module).items() if callable(v)]
    else:
        path = Path(target)
        if not path.is_file():
            raise ModelNotFoundError(f"factory file {target} does not exist.")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            return  # importing it says where
        names = _top_level_names(tree)
        if names is None:  # a star import may bring anything: running it will tell
            return
    if func_name not in names:
        own = [n for n in names if not n.startswith("_")]
        raise ModelNotFoundError(f"{target} has no function {func_name!r}.{_did_you_mean(func_name, own)}")


def _top_level_names(tree: ast.Module | ast.stmt) -> list[str] | None:
    """Names a module binds at its top level, in any branch of an ``if``/``try``/``with`` there
    (None when it star-imports: then anything may be defined)."""
    names: list[str] = []
    body = list(getattr(tree, "body", []))
    for extra in ("orelse", "finalbody"):
        body += list(getattr(tree, extra, []) or [])
    for handler in getattr(tree, "handlers", []) or []:
        body += list(handler.body)
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names += [(a.asname or a.name).split(".")[0] for a in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names += [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = _top_level_names(node)
            if inner is None:
                return None
            names += inner
    return names


def _did_you_mean(name: str, known: list[str]) -> str:
    """`` Did you mean X?`` for the known names closest to ``name`` (spelling or family), else "".

    >>> _did_you_mean("gtp2", ["gpt2", "gpt2-medium", "llama-7b"]), _did_you_mean("llama", ["llama-7b", "llama-13b"])
    (' Did you mean gpt2?', ' Did you mean llama-7b, llama-13b?')
    """
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.7)
    close = close or [n for n in known if n.split("-")[0] == name.split("-")[0]]
    return f" Did you mean {', '.join(close)}?" if close else ""


def _from_builtin(name: str, device: torch.device, b: int, t: int, dropout: float | None) -> ModelSpec:
    import transformers

    entry = BUILTINS[name]
    config = getattr(transformers, entry.config)(**entry.settings)
    config.architectures = config.architectures or [entry.model]  # as a saved folder would name it
    return _from_config(config, getattr(transformers, entry.model), entry.task, name, "builtin", device, b, t, dropout)


def _from_folder(path: Path, device: torch.device, b: int, t: int, dropout: float | None, load: bool = True) -> ModelSpec:
    import transformers

    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelNotFoundError(f"{path} has no config.json; a HuggingFace model folder needs one.")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (ValueError, OSError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"{cfg_file} could not be read as a HuggingFace config: {e}") from None
    archs = getattr(config, "architectures", None) or []
    cls = next((getattr(transformers, a) for a in archs if hasattr(transformers, a)), None)
    if cls is None:
        raise ModelNotFoundError(
            f"{cfg_file} names no model class transformers knows ({archs or 'no architectures field'}); "
            "add \"architectures\": [\"...ForCausalLM\"] to it."
        )
    task = _task_of(cls.__name__)
    ms = _from_config(config, cls, task, str(path), "folder", device, b, t, dropout)
    weights = list(path.glob("*.safetensors")) + list(path.glob("pytorch_model*.bin"))
    if weights and load and device.type != "meta":
        loaded = cls.from_pretrained(str(path), local_files_only=True, config=config)
        ms.model = loaded.to(device).train()
    return ms


def _task_of(class_name: str) -> str:
    for suffix, task in (("ForCausalLM", "causal-lm"), ("LMHeadModel", "causal-lm"), ("ForMaskedLM", "masked-lm"),
                         ("ForConditionalGeneration", "seq2seq"), ("ForImageClassification", "image-classification"),
                         ("ForSequenceClassification", "sequence-classification")):
        if class_name.endswith(suffix):
            return task
    return "custom"


def _from_config(config: Any, cls: Any, task: str, name: str, source: str, device: torch.device,
                 b: int, t: int, dropout: float | None) -> ModelSpec:
    if dropout is not None:
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
                    "dropout_rate", "dropout", "attention_dropout"):
            if hasattr(config, key):
                setattr(config, key, dropout)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    with torch.device(device):
        model = cls(config)
    model.train()
    if task == "causal-lm" and getattr(model, "loss_type", "") is None:
        # transformers names the loss after the class (GPT2LMHeadModel is no "...ForCausalLM"), finds
        # none, takes ForCausalLM and says so at the first loss, on every rank: say it for it
        model.loss_type = "ForCausalLM"
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    # the example batch is drawn on the CPU and moved: a caller may hold a torch.device(...) context
    # (the untouched model for --verify is built on the job's GPU), and a CPU generator then fails
    g = torch.Generator().manual_seed(0)
    if task == "image-classification":
        size = int(config.image_size)
        pixels = torch.randn(b, int(config.num_channels), size, size, generator=g, device="cpu").to(device)
        labels = torch.randint(0, int(config.num_labels), (b,), generator=g, device="cpu").to(device)
        return ModelSpec(name, model, (pixels,), {"labels": labels}, task, source, 0, b, 0)
    limit = int(getattr(config, "max_position_embeddings", getattr(config, "n_positions", t)) or t)
    if t > limit:
        raise ModelNotFoundError(f"--seq-len {t} is longer than {name}'s {limit} positions; use at most {limit}.")
    ids = torch.randint(0, vocab, (b, t), generator=g, device="cpu").to(device)
    kwargs: dict[str, Any] = {"labels": ids}
    if task == "masked-lm":
        # its own tensor: traced with the very object of the inputs, the graph reads the ids through
        # the labels, and a masked LM's labels differ from its (masked) inputs
        kwargs = {"labels": ids.clone()}
    if task == "seq2seq":
        kwargs = {"labels": torch.randint(0, vocab, (b, t), generator=g, device="cpu").to(device)}
    if task == "sequence-classification":
        kwargs = {"labels": torch.randint(0, int(config.num_labels), (b,), generator=g, device="cpu").to(device)}
    if "use_cache" in inspect.signature(model.forward).parameters or task in ("causal-lm", "seq2seq"):
        kwargs["use_cache"] = False
    return ModelSpec(name, model, (ids,), kwargs, task, source, vocab, b, t)


def _from_factory(spec: str, device: torch.device, b: int | None, t: int) -> ModelSpec:
    target, _, func_name = spec.rpartition(":")
    module = _import_target(target)
    fn = getattr(module, func_name, None)
    if not callable(fn):
        own = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
               and getattr(v, "__module__", None) == module.__name__]
        raise ModelNotFoundError(f"{target} has no function {func_name!r}.{_did_you_mean(func_name, own)}")
    with torch.device(device):
        result = _call_flexibly(fn, b, t)
        if isinstance(result, nn.Module):
            example = getattr(module, "example_inputs", None)
            if not callable(example):
                raise ModelNotFoundError(
                    f"{spec} returned a model but no example inputs: return (model, example_args[, example_kwargs]) "
                    f"or define example_inputs(batch_size, seq_len) in {target}."
                )
            result = (result, _call_flexibly(example, b, t))
            if isinstance(result[1], tuple) and len(result[1]) == 2 and isinstance(result[1][1], dict):
                result = (result[0], result[1][0], result[1][1])
    loss = data = None
    if isinstance(result, dict):
        unknown = set(result) - {"model", "args", "kwargs", "loss", "data"}
        if unknown or "model" not in result:
            raise ModelNotFoundError(
                f"{spec} returned a dict with keys {sorted(result)}; use model, args, kwargs, loss and data "
                f"({'unknown: ' + ', '.join(sorted(unknown)) if unknown else 'model is missing'})."
            )
        loss, data = result.get("loss"), result.get("data")
        if loss is not None and not callable(loss):
            raise ModelNotFoundError(f"{spec}: 'loss' must be a function loss(outputs, target), got {type(loss).__name__}.")
        result = (result["model"], result.get("args", ()), result.get("kwargs", {}))
    if not isinstance(result, tuple) or not result or not isinstance(result[0], nn.Module):
        raise ModelNotFoundError(f"{spec} must return an nn.Module, (model, example_args[, example_kwargs]) or a dict.")
    model, args, kwargs = result[0], result[1] if len(result) > 1 else (), result[2] if len(result) > 2 else {}
    if not isinstance(args, tuple):
        args = (args,)
    kwargs = _no_cache(model, dict(kwargs))
    own = _rows(args, kwargs)
    if b is not None and own not in (None, b):
        args, kwargs = _resize_rows((args, kwargs), own, b)
    config = getattr(model, "config", None)
    task = _task_of(type(model).__name__) if config is not None else "custom"
    if task in ("causal-lm", "masked-lm", "seq2seq") and args and isinstance(args[0], torch.Tensor) \
            and args[0].is_floating_point():
        task = "custom"  # features in, not token ids (Whisper): no token data to feed it
    vocab = int(getattr(config, "vocab_size", 0) or 0) if config is not None else 0
    rows = b if b is not None else (own or 1)
    # a factory may fix its sequence length whatever it is asked for: the spec says what it traces with
    width = args[0].shape[1] if task in ("causal-lm", "masked-lm") and args and isinstance(args[0], torch.Tensor) \
        and args[0].dim() == 2 and not args[0].is_floating_point() else t
    return ModelSpec(spec, model, args, dict(kwargs), task, "factory", vocab, rows, int(width), loss=loss, data=data)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The example's micro-batch: the rows of its first tensor with a dimension (None without one)."""
    first = next((v for v in tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    return int(first.shape[0]) if first is not None else None


def _resize_rows(tree: Any, own: int, rows: int) -> Any:
    """Every example tensor of ``own`` rows cut or repeated (cyclically) to ``rows``: shapes and
    values stay the model's (ids in its vocabulary, masks of its kind)."""

    def resize(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != own:
            return v
        if v.is_meta:
            return torch.empty((rows, *v.shape[1:]), dtype=v.dtype, device=v.device)
        return v[torch.arange(rows, device=v.device) % own]

    return tree_map(resize, tree)


def _no_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Training keeps no key/value cache: a HuggingFace model that would return one (its config's
    ``use_cache``, on by default) returns a cache object that cannot cross a pipeline cut."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False
    takes = "use_cache" in _parameters(model.forward)
    if kwargs.get("use_cache") or (takes and config is not None and "use_cache" not in kwargs):
        kwargs["use_cache"] = False
    return kwargs


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _call_flexibly(fn: Callable[..., Any], b: int | None, t: int) -> Any:
    """Pass batch_size / seq_len only to factories that take them (batch_size only when given)."""
    params = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in (("batch_size", b), ("seq_len", t)) if k in params and v is not None}
    return fn(**kwargs)


def _import_target(target: str) -> Any:
    if target.endswith(".py"):
        path = Path(target)
        if not path.exists():
            raise ModelNotFoundError(f"factory file {target} does not exist.")
        name = f"autopipe_factory_{path.stem}"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        with _on_path(path.parent):
            spec.loader.exec_module(module)
        return module
    try:
        with _on_path(Path.cwd()):
            return importlib.import_module(target)
    except ModuleNotFoundError as e:
        raise ModelNotFoundError(f"cannot import {target!r} ({e}); check the module path or use file.py:function.") from None


@contextlib.contextmanager
def _on_path(folder: Path) -> Iterator[None]:
    sys.path.insert(0, str(folder))
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(str(folder))
