"""Which torchtitan an export is for, and the names torchtitan's splitter finds the plan's modules by.

torchtitan's splitter (``_split_module`` in 0.3, ``pipeline_module_split`` in 0.2) walks the model's
top-level children only: it keeps a child it is told, and the entries of a top-level layer container
it is told (``layers.3``); every other child becomes None (an Identity in the HuggingFace backend).
A name two levels down (``model.layers.3``) matches nothing and is dropped without an error, so the
export writes the names torchtitan's model has:

- a torchtitan model (or one named like it: ``tok_embeddings``, ``layers.N``, ``norm``, the head)
  keeps its names, the head named as the version names it (``output`` up to 0.2, ``lm_head`` from 0.3);
- a HuggingFace Llama-shaped model (``model.embed_tokens``, ``model.layers.N``, ``model.norm``,
  ``model.rotary_emb``, ``lm_head``) runs on torchtitan's HuggingFace backend
  (experiments/transformers_modeling_backend), whose model shows those modules as top-level children
  named ``tok_embeddings``, ``layers``, ``norm``, the head and ``rotary_emb``; every part lists
  ``rotary_emb`` (the backend's own split does: each stage computes the rotary embedding);
- anything else is refused in one line.

Example:
    >>> titan_parts([["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]],
    ...             titan_version("0.3")).parts[1]
    ('layers.1', 'norm', 'lm_head', 'rotary_emb')
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from ...errors import ExportError

__all__ = ["TitanVersion", "titan_version", "installed_titan", "TitanParts", "titan_parts", "HF_BACKEND"]

HF_BACKEND = "transformers_modeling_backend"  # torchtitan's module name for its HuggingFace backend
KNOWN = ("0.2", "0.3")  # the config forms autopipe writes: 0.2's TOML, 0.3's config function


@dataclass(frozen=True)
class TitanVersion:
    """The torchtitan release an export is written for, and what that release reads."""

    release: str  # "0.3.0", or "0.3" when named without a patch number
    installed: bool = False  # read from the installed package

    @property
    def minor(self) -> str:
        return ".".join(self.release.split(".")[:2])

    @property
    def toml(self) -> bool:
        """0.2 and before read a TOML file (--job.config_file); 0.3 a Python config function."""
        return self.minor == "0.2"

    @property
    def head(self) -> str:
        return "output" if self.toml else "lm_head"


def installed_titan() -> str | None:
    """The installed torchtitan's version, read from its metadata (importing it takes seconds), or None."""
    from importlib import metadata

    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def titan_version(asked: str | None = None) -> TitanVersion:
    """``asked`` ("0.2", "0.2.2", "0.3"), else the installed torchtitan's, else 0.3 (the current release).

    >>> titan_version("0.2.2").toml, titan_version("0.3").head
    (True, 'lm_head')
    """
    release, installed = (asked.strip(), False) if asked else (installed_titan() or "0.3", asked is None)
    m = re.match(r"^(\d+)\.(\d+)(\.\d+)?", release)
    minor = f"{m.group(1)}.{m.group(2)}" if m else ""
    if minor not in KNOWN:
        where = "the installed torchtitan is" if installed and asked is None else "asked for"
        raise ExportError(f"autopipe writes torchtitan 0.2's TOML and 0.3's config function, and {where} {release!r}; "
                          "export --to torchtitan@0.3 (or @0.2) and check its keys against your version's config.")
    return TitanVersion(release if m and m.group(3) else minor, installed and bool(m and m.group(3)))


@dataclass(frozen=True)
class TitanParts:
    """The plan's parts in torchtitan's names: ``backend`` is "model" (torchtitan's own model, or one
    named like it) or "hf" (the HuggingFace backend); ``renamed`` the (model's name, torchtitan's) pairs."""

    backend: str
    parts: tuple[tuple[str, ...], ...]
    renamed: tuple[tuple[str, str], ...] = ()


def _hf_name(unit: str, head: str) -> str | None:
    """A HuggingFace Llama-shaped module's name in torchtitan's HuggingFace backend, or None."""
    fixed = {"model.embed_tokens": "tok_embeddings", "model.norm": "norm", "model.rotary_emb": "rotary_emb",
             "lm_head": head}  # fmt: skip
    if unit in fixed:
        return fixed[unit]
    m = re.fullmatch(r"model\.layers\.(\d+)", unit)
    return f"layers.{m.group(1)}" if m else None


def _splittable(unit: str) -> bool:
    """What torchtitan's splitter can keep: a top-level child, or an entry of a top-level layer list."""
    parts = unit.split(".")
    return len(parts) == 1 or (len(parts) == 2 and parts[1].isdigit())


def titan_parts(modules: Sequence[Sequence[str]], version: TitanVersion) -> TitanParts:
    """Per part, the names torchtitan ``version`` keeps the plan's modules by; ExportError (one line)
    for a module torchtitan's splitter cannot find."""
    units = [u for part in modules for u in part]
    if any(u.startswith("model.") for u in units) and all(_hf_name(u, version.head) for u in units):
        parts = []
        for part in modules:
            names = [_hf_name(u, version.head) or u for u in part]
            parts.append(tuple(names + ["rotary_emb"] * ("rotary_emb" not in names)))
        renamed = tuple((u, _hf_name(u, version.head) or u) for u in dict.fromkeys(units))
        return TitanParts("hf", tuple(parts), renamed)
    odd = next((u for u in units if not _splittable(u)), None)
    if odd is not None:
        raise ExportError(f"torchtitan's splitter keeps only top-level modules and the entries of a top-level layer "
                          f"list (tok_embeddings, layers.3, norm, {version.head}), and would silently drop {odd}; its "
                          "HuggingFace backend takes Llama-shaped models (model.embed_tokens, model.layers.N, "
                          "model.norm, lm_head); export --to fqns or deepspeed for this model.")  # fmt: skip
    titan_like = "tok_embeddings" in units
    other = {"lm_head": "output", "output": "lm_head"}
    rename = {u: version.head for u in other if titan_like and u in units and u != version.head}
    parts = tuple(tuple(rename.get(u, u) for u in part) for part in modules)
    return TitanParts("model", parts, tuple(rename.items()))
