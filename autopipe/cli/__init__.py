"""The command line: a thin typer layer over the library (the ``autopipe`` entry point is ``app``).

Each command parses, calls the library, renders with rich; errors become one red line and exit 1
(``cli.app``). The commands live in ``pass_commands`` (inspect, profile, plan), ``job_commands``
(convert, report), ``export_commands`` (export) and ``doctor_commands`` (doctor); importing them registers them on ``app``.
"""

from __future__ import annotations

from . import doctor_commands, export_commands, job_commands, pass_commands  # noqa: F401  (register the commands)
from .app import app

__all__ = ["app", "main"]


def main() -> None:
    app()
