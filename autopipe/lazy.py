"""Package faces that import their modules on first use, so that ``import autopipe`` (and a
torch-free folder beneath it) never loads torch until a name that needs it is asked for."""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that imports ``names[name]`` (a submodule, relative
    to the package, or a whole dotted ``autopipe.`` name for a module of another folder) on first
    access and keeps the value in ``namespace`` (the package's globals).

    >>> ns = {}
    >>> get = lazy_exports("autopipe", {"precision": "choices"}, ns)
    >>> get("precision")("bfloat16"), "precision" in ns
    ('bf16', True)
    """

    def __getattr__(name: str) -> Any:
        try:
            module = names[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        value = getattr(import_module(module if module.startswith("autopipe.") else f"{package}.{module}"), name)
        namespace[name] = value
        return value

    return __getattr__
