"""The command line: a thin typer layer over the library.

Each command parses, calls the library, renders with rich; errors become one red line and exit 1
(see ``cli_base``). The commands live in ``cli_commands`` (inspect, profile, plan) and
``cli_convert`` (convert, report); importing them registers them on ``app``.
"""

from __future__ import annotations

from . import cli_commands, cli_convert  # noqa: F401  (register the commands)
from .cli_base import app

__all__ = ["app", "main"]


def main() -> None:
    app()
