"""``--resume``: continue a run from the newest checkpoint in its folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import AutopipeError

__all__ = ['ResumeError', 'resume']


class ResumeError(AutopipeError):
    """--resume found nothing to resume, or a checkpoint that does not fit this run."""


def resume(trainer: Any, ckpt_dir: str | os.PathLike[str], *, mode: str, steps: int, data: Any = None,
           say: Callable[[str], None] = print) -> Path | None:
    """Load the newest checkpoint under ``ckpt_dir`` into ``trainer`` (``mode`` "must" or "auto").

    Returns the checkpoint, or None when ``mode`` is "auto" and there is none.
    """
    from .folders import claim_ckpt_dir, latest_checkpoint, read_meta
    from .store import check_shared_folder, load_checkpoint

    if getattr(trainer, "env", None) is not None:  # else each node would find its own newest checkpoint
        check_shared_folder(trainer.env, ckpt_dir)
    last = latest_checkpoint(ckpt_dir)
    claim_ckpt_dir(ckpt_dir)  # this run continues what is there (or, with none, starts it afresh)
    if last is None:
        if mode == "auto":
            say(f"no checkpoint in {ckpt_dir}: starting at step 0 (--resume auto)")
            return None
        raise ResumeError(
            f"--resume: no checkpoint in {ckpt_dir}; check --ckpt-dir, or use --resume auto to start afresh when there is none."
        )
    load_checkpoint(trainer, last)
    meta = read_meta(last)
    say(f"resumed from {last} at step {trainer.step_count}")
    saved_steps = int(meta.get("config", {}).get("steps", steps))
    if saved_steps != steps:
        say(f"note: the checkpoint was trained for --steps {saved_steps}; the learning rate now decays over "
            f"{steps} steps from step {trainer.step_count}")
    if data is not None and meta.get("data") and meta["data"].get("source") != data.state().get("source"):
        say(f"note: the checkpoint was trained on {meta['data']['source']}; this run reads {data.state()['source']}")
    if trainer.step_count >= steps:
        raise ResumeError(f"{last} is at step {trainer.step_count}, already at --steps {steps}: pass a larger --steps to train on.")
    return last
