"""Files autopipe writes: atomically (a crash never leaves half a file), and JSON records with a kind
and a schema version that are checked when read back. No torch."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from .errors import RecordError

__all__ = ["write_text_atomic", "write_json_atomic", "read_json", "check_header"]


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to a temporary name beside ``path`` and rename, so a crash never leaves half a file.

    On failure the temporary file is removed and the OSError names ``path`` ("cannot write
    out/plan.json: Is a directory"), not the temporary name.

    Example:
        >>> write_text_atomic("jobs/gpt2/README.md", "# Pipeline job\\n")
        PosixPath('jobs/gpt2/README.md')
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise type(e)(e.errno, f"cannot write {path}: {e.strerror or e}") from e
    return path


def check_header(d: Any, what: str, schema: int, redo: str) -> None:
    """A saved record names its kind and schema; refuse others with what to do instead."""
    if not isinstance(d, dict) or d.get("kind") != f"autopipe.{what}":
        raise RecordError(f"not an autopipe {what} (missing kind 'autopipe.{what}').")
    if d.get("schema") != schema:
        raise RecordError(
            f"{what} schema {d.get('schema')} is not supported (this autopipe reads {schema}); {redo}."
        )


def read_json(path: str | os.PathLike[str], what: str) -> Any:
    """A saved record's JSON, or a RecordError saying it is missing or malformed."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise RecordError(f"no {what} at {path}.") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{path} is not valid JSON ({e}).") from None


def write_json_atomic(path: str | os.PathLike[str], data: Any) -> None:
    """Write JSON atomically (see :func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(data, indent=1, sort_keys=False) + "\n")
