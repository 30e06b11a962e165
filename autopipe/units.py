"""Sizes in bytes (and bandwidths in bytes/s): read "80GiB" / "25GB" from the command line; write sizes,
seconds and micro-batch shapes for people.

Example:
    >>> parse_size("1.5KiB"), format_bytes(1536)
    (1536, '1.50 KiB')
"""

from __future__ import annotations

import re
from typing import Mapping, Sequence

from .errors import PartitionError

__all__ = ["format_bytes", "format_microbatch", "format_time", "parse_bandwidth", "parse_size", "shorten"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_size(text: str | int | float) -> int:
    """Bytes from "80GiB", "512MB", "1.5g" or a plain number of bytes.

    Example:
        >>> parse_size("1.5KiB")
        1536
    """
    return int(_parse(text, "memory size", "like 80GiB, 512MB or 1.5TB", "bytes"))


def parse_bandwidth(text: str | int | float) -> float | None:
    """Bytes per second from "25GB", "900GB" or a plain number; None for "none" (no communication cost).

    Example:
        >>> parse_bandwidth("25GB"), parse_bandwidth("none")
        (25000000000.0, None)
    """
    if isinstance(text, str) and text.strip().lower() in ("none", "inf"):
        return None
    return float(_parse(text, "bandwidth", "in bytes per second, like 25GB or 900GB, or 'none'", "bytes per second"))


def _parse(text: str | int | float, what: str, example: str, unit_name: str) -> int:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise PartitionError(f"bad {what} {text!r}: give a number with a unit, {example}.")
        value, unit = float(m.group(1)), m.group(2).lower()
    size = int(value * _UNITS[unit])
    if size <= 0:
        raise PartitionError(f"{what} {text!r} must be more than 0 {unit_name}.")
    return size


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shorten(text: str, n: int) -> str:
    """``text`` cut to ``n`` characters with an ellipsis."""
    return text if len(text) <= n else text[: n - 1] + "…"


def format_time(seconds: float) -> str:
    """0.0123 -> '12.3 ms'; picks µs, ms or s, three significant digits."""
    if seconds == 0:
        return "0"
    for unit, scale in (("µs", 1e-6), ("ms", 1e-3)):
        if seconds < 1000 * scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"


def format_microbatch(shapes: Mapping[str, Sequence[int]]) -> str:
    """{'args[0]': [1, 64], 'labels': [1, 64]} -> 'args[0] 1×64, labels 1×64'."""
    return ", ".join(f"{name} {'×'.join(map(str, shape)) or 'scalar'}" for name, shape in shapes.items())
