"""A run's checkpoint folder, read without torch: its complete checkpoints, the newest one, a
checkpoint's meta.json, and the rule that a run never saves into another run's folder.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ...errors import AutopipeError, RecordError

__all__ = ["CheckpointFolderError", "check_ckpt_dir", "checkpoint_dirs", "claim_ckpt_dir", "latest_checkpoint", "read_meta",
           "saved_steps"]


_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointFolderError(AutopipeError):
    """The checkpoint folder holds another run's checkpoints."""


_CLAIMED: set[str] = set()  # checkpoint folders this process saves into: empty, or resumed from


def saved_steps(root: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints under ``root``, oldest first: autopipe's (``meta.json`` written last)
    and DeepSpeed's (its ``step_N`` tags, each with its model states)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)
             and ((p / "meta.json").is_file() or any(p.glob("*model_states.pt")))]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def claim_ckpt_dir(root: str | os.PathLike[str]) -> None:
    """Mark ``root`` as this run's: it resumed from the checkpoints there (``resume`` calls it)."""
    _CLAIMED.add(os.path.abspath(root))


def check_ckpt_dir(root: str | os.PathLike[str], *, resume: Any = None, saving: bool = True) -> None:
    """Refuse, in one line, a run that would save into a folder holding another run's checkpoints.

    Called by every rank at the start of train.py (all see the same folder), and by the first save.
    With ``resume`` the checkpoints there are this run's own past; a run that saves nothing
    (``saving`` False) touches nothing.
    """
    key = os.path.abspath(root)
    if resume or not saving or key in _CLAIMED:
        return
    existing = saved_steps(root)
    if existing:
        steps = [int(_STEP_DIR.match(p.name).group(1)) for p in existing]  # type: ignore[union-attr]
        held = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]} ({len(steps)} checkpoints)"
        raise CheckpointFolderError(
            f"checkpoint folder {root} holds another run's checkpoints ({held}); nothing was written. "
            "Continue that run with --resume, or save this one elsewhere with --ckpt-dir DIR."
        )
    _CLAIMED.add(key)


def checkpoint_dirs(root: Path) -> list[Path]:
    """autopipe's complete checkpoints under ``root`` (``meta.json`` written last), oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))  # type: ignore[union-attr]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint folder under ``root`` (None if there is none)."""
    dirs = checkpoint_dirs(Path(root))
    return dirs[-1] if dirs else None


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    p = Path(path) / "meta.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise RecordError(f"{p} is missing or unreadable ({e}); the checkpoint is incomplete.") from e
