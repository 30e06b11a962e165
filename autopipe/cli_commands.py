"""CLI commands. Each one: parse, call the library, render. Keep them thin."""

from __future__ import annotations

from .cli import app, console, handle_errors  # noqa: F401
