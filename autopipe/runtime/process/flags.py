"""train.py's flags, read so that a mistake is one line from rank 0 that says what was meant.

A train.py declares each setting once, as a field of a dataclass: its default is the job's value,
its type the flag's type (``Literal[...]`` its choices, ``X | None`` optional, a bool a switch), and
the comment after it (with any comment lines right under it) the flag's help:

    @dataclass
    class Settings:
        lr: float = 3e-4  # peak learning rate
        dtype: Literal["fp32", "bf16"] = "fp32"
        resume: Optional[str] = flag(None, bare="must")  # --resume alone means "must"

    cfg = parse_flags(Settings)  # --lr 1e-3 --dtype bf16; --batch-size and --batch_size alike

argparse prints its usage and error on every rank and exits with status 2; under torchrun that is
the same complaint once per process, then torchrun's summary. ``parse_flags`` turns each of
argparse's errors into an :class:`AutopipeError` (``one_line_errors`` prints it once, from rank 0),
and a flag train.py does not have into the one it was probably meant to be:

    error: unknown flag --stpes; did you mean --steps?
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import io
import sys
import tokenize
import types
import typing
from typing import Any, Literal, TypeVar, Union

from ...errors import AutopipeError

__all__ = ["FlagError", "flag", "float_pair", "parse_flags", "read_flags", "settings_parser", "suggest_flag"]

T = TypeVar("T")


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


def flag(default: Any, *, bare: Any = None, hidden: bool = False) -> Any:
    """A settings field with more than a default: ``bare`` is the value of the flag given without
    one (``--resume`` alone), ``hidden`` keeps it out of ``--help`` (a launcher's own flag)."""
    return dataclasses.field(default=default, metadata={"bare": bare, "hidden": hidden})


def parse_flags(settings: type[T] | argparse.ArgumentParser, argv: list[str] | None = None) -> Any:
    """The settings with the flags given applied (a ``Settings`` dataclass: an instance of it; an
    ``ArgumentParser``, as train.py files before the dataclass passed: its namespace), errors as one
    line (see the module docstring). Installs ``one_line_errors`` first, and points its Ctrl-C hint
    at ``ckpt_dir`` once it is known."""
    from .lifecycle import one_line_errors

    one_line_errors()
    args = read_flags(settings, argv)
    if getattr(args, "ckpt_dir", None) is not None:
        one_line_errors(args.ckpt_dir)
    return args


def read_flags(settings: type[T] | argparse.ArgumentParser, argv: list[str] | None = None) -> Any:
    """``parse_flags`` without installing anything: a bad flag raises :class:`FlagError` (what
    ``autopipe run`` checks before it launches a process)."""
    parser = settings if isinstance(settings, argparse.ArgumentParser) else settings_parser(settings)

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
    if isinstance(settings, argparse.ArgumentParser):
        return args
    return settings(**vars(args))


def settings_parser(settings: type, description: str | None = None) -> argparse.ArgumentParser:
    """An ArgumentParser with one flag per field of the dataclass ``settings`` (see the module
    docstring); its description is the docstring of the module that defines ``settings``."""
    module = sys.modules.get(settings.__module__)
    parser = argparse.ArgumentParser(description=description or getattr(module, "__doc__", None),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(settings, vars(module) if module else None)
    helps = _field_comments(settings)
    for f in dataclasses.fields(settings):
        names = [f"--{f.name.replace('_', '-')}"] + ([f"--{f.name}"] if "_" in f.name else [])
        kind, optional = _unwrap(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        extra: dict[str, Any] = {"default": default, "dest": f.name}
        if f.metadata.get("hidden"):
            extra["help"] = argparse.SUPPRESS
        else:
            extra["help"] = helps.get(f.name, "") + (f" (default: {default})" if default not in (None, "", False) else "")
        if kind is bool:
            extra["action"] = argparse.BooleanOptionalAction if default else "store_true"
        else:
            choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
            if choices:
                extra.update(choices=choices, type=type(choices[0]))
            elif typing.get_origin(kind) is tuple:
                extra["type"] = float_pair
            else:
                extra["type"] = kind
            if f.metadata.get("bare") is not None:
                extra.update(nargs="?", const=f.metadata["bare"])
            if optional and extra.get("type") is str:
                extra["type"] = str
        parser.add_argument(*names, **extra)
    return parser


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (hint, False)."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return hint, False


def _field_comments(settings: type) -> dict[str, str]:
    """Each field's help: the comment after it, with the comment lines right under it (a blank line
    or a section's ``# ----`` line ends it). Empty when the class has no source (``python -c``)."""
    try:
        source = inspect.getsource(settings)
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    names = {f.name for f in dataclasses.fields(settings)}
    out: dict[str, str] = {}
    current: str | None = None
    for number, line in enumerate(source.splitlines(), start=1):
        text = line.strip()
        head = text.split(":", 1)[0].strip()
        if text.startswith("#"):
            if current is None or comments.get(number, "").startswith("----"):
                current = None
            else:
                out[current] = f"{out[current]} {comments[number]}".strip()
        elif head in names and ":" in text:
            current = head
            out[head] = comments.get(number, "")
        else:
            current = None
    return out


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
