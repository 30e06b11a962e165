"""What the bench scripts share about their results files."""

from __future__ import annotations

from pathlib import Path


def write_keeping_notes(path: Path, text: str) -> None:
    """Write a bench's generated markdown to ``path``, keeping the notes people wrote under it: the
    old file from its first ``## `` heading on (the tables use ``#`` and ``###``). A rerun replaces
    the figures, not their reading."""
    old = path.read_text().splitlines() if path.exists() else []
    notes = next((old[i:] for i, line in enumerate(old) if line.startswith("## ")), [])
    path.write_text(text.rstrip("\n") + "\n" + ("\n" + "\n".join(notes) + "\n" if notes else ""))
