"""train.py's flags, read so that a mistake is one line from rank 0 that says what was meant.

argparse prints its usage and error on every rank and exits with status 2; under torchrun that is
the same complaint once per process, then torchrun's summary. ``parse_flags`` turns each of
argparse's errors into an :class:`AutopipeError` (``one_line_errors`` prints it once, from rank 0),
and a flag train.py does not have into the one it was probably meant to be:

    error: unknown flag --stpes; did you mean --steps?
"""

from __future__ import annotations

import argparse
import difflib
from typing import Any

from ...errors import AutopipeError

__all__ = ["FlagError", "float_pair", "parse_flags", "suggest_flag"]


class FlagError(AutopipeError):
    """A flag train.py does not have, or a value it cannot take."""


def suggest_flag(flag: str, known: list[str]) -> str:
    """``flag``'s nearest known flag as a hint, or the advice to read ``--help``.

    >>> suggest_flag("--stpes", ["--steps", "--seed"]), suggest_flag("--zzz", ["--steps"])
    ('did you mean --steps?', 'see --help for the flags.')
    """
    name = flag.split("=", 1)[0]
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"did you mean {near[0]}?" if near else "see --help for the flags."


def parse_flags(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, errors as one line (see the module docstring). Installs
    ``one_line_errors`` first, and points its Ctrl-C hint at ``--ckpt-dir`` once it is known."""
    from .lifecycle import one_line_errors

    one_line_errors()

    def error(message: str) -> Any:
        raise FlagError(f"{message} (python train.py --help lists the flags).")

    parser.error = error  # type: ignore[method-assign]
    args, unknown = parser.parse_known_args(argv)
    flags = [f for f in unknown if f.startswith("-")]
    if unknown:
        known = [o for action in parser._actions for o in action.option_strings if o.startswith("--")]
        if flags:
            raise FlagError(f"unknown flag {flags[0].split('=', 1)[0]}; {suggest_flag(flags[0], known)}")
        raise FlagError(f"unexpected argument {unknown[0]!r}: train.py takes flags only (python train.py --help).")
    if getattr(args, "ckpt_dir", None) is not None:
        one_line_errors(args.ckpt_dir)
    return args


def float_pair(text: str) -> tuple[float, float]:
    """``"0.9,0.95"`` -> ``(0.9, 0.95)``: an argparse type for ``--betas``.

    >>> float_pair("0.9,0.95"), float_pair("0.9 0.999")
    ((0.9, 0.95), (0.9, 0.999))
    """
    parts = text.replace(",", " ").split()
    try:
        a, b = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not two numbers, like 0.9,0.95") from None
    return a, b
