"""What every CLI command module shares: the typer app, the consoles and the error handling.

Command modules (pass_commands, job_commands) import this and register on ``app``; ``autopipe.cli``
imports them all. Nothing here imports a command module, so the imports run one way.

Library errors (AutopipeError) and file errors (OSError: a folder given as --out, no permission)
become one red line and exit code 1; AUTOPIPE_DEBUG=1 shows the traceback instead.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable, TypeVar

import typer
from rich.console import Console

from ..errors import AutopipeError

__all__ = ["app", "console", "err_console", "handle_errors", "zero_option"]

app = typer.Typer(
    name="autopipe",
    help="Trace, profile and auto-partition PyTorch models for pipeline-parallel training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# no emoji codes: a model spec "file.py:fire" would print a flame (rich reads :fire: as one)
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn library and file errors into one red line and exit 1 (AUTOPIPE_DEBUG=1: full traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (AutopipeError, OSError) as e:
            if os.environ.get("AUTOPIPE_DEBUG"):
                raise
            err_console.print(f"[bold red]error:[/] {_message(e)}", highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _message(e: Exception) -> str:
    """One line for the user: ours as written; an OS error as "cannot access PATH: Is a directory"."""
    if isinstance(e, OSError) and e.strerror:
        # The atomic writers already say "cannot write PATH: ..."; other OS errors name their file.
        return f"cannot access {e.filename}: {e.strerror}" if e.filename else e.strerror
    return str(e)


def zero_option(text: str) -> int | str:
    """--zero's value: a ZeRO stage 0-3, or "auto" (partition checks the range)."""
    word = text.strip().lower()
    if word == "auto":
        return word
    try:
        return int(word)
    except ValueError:
        raise AutopipeError(f"--zero {text!r}: use a ZeRO stage 0, 1, 2 or 3, or auto.") from None
