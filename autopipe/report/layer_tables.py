"""Rendering a LayerSequence for people: the table `autopipe inspect` prints."""

from __future__ import annotations

from rich.table import Table

from ..graph.sequence import LayerSequence, TensorSig

__all__ = ["layer_table", "format_count", "format_sig", "made_on_stage"]

_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32", "bool": "bool"}


def format_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def format_sig(sigs: tuple[TensorSig, ...]) -> str:
    """``(i64[1,128], f32[1,128,768])``: the tuple crossing a cut."""
    parts = [f"{_SHORT.get(s.dtype, s.dtype)}[{','.join(map(str, s.shape))}]" for s in sigs]
    return "(" + ", ".join(parts) + ")" if len(parts) != 1 else parts[0]


def layer_table(seq: LayerSequence, *, title: str = "") -> Table:
    table = Table(title=title or None, show_lines=False, header_style="bold")
    table.add_column("#", justify="right")
    table.add_column("name")
    table.add_column("kind")
    table.add_column("params", justify="right")
    table.add_column("in")
    table.add_column("out")
    table.add_column("tied")
    for info in seq.infos:
        table.add_row(
            str(info.index),
            info.name,
            info.kind,
            format_count(info.params),
            format_sig(info.inputs),
            format_sig(info.outputs),
            "⛓ " + ", ".join(info.tied) if info.tied else "",
        )
    return table


def made_on_stage(seq: LayerSequence) -> str:
    """One line naming the batch-free values the layers make on their stage instead of receiving them
    (``bool[1,1,64,64] (layers 1-12)``), or "" when there are none."""
    readers: dict[str, tuple[TensorSig, list[int]]] = {}
    for info in seq.infos:
        for sig in info.computed:
            readers.setdefault(sig.name, (sig, []))[1].append(info.index)
    parts = [f"{format_sig((sig,))} (layers {_ranges(layers)})" for sig, layers in readers.values()]
    return "made on each stage, never sent: " + ", ".join(parts) if parts else ""


def _ranges(indices: list[int]) -> str:
    """``1-3, 5``: consecutive layer indices as ranges."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
