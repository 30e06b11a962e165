"""Checkpoints: per-stage shards written atomically, one run per folder, ``--resume``, and the
export of the trained weights as one safetensors file.

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "checkpoint_params": "exports",
    "export": "exports",
    "export_final": "exports",
    "write_stage_weights": "exports",
    "ResumeError": "resume",
    "resume": "resume",
    "CheckpointFolderError": "store",
    "check_ckpt_dir": "store",
    "check_shared_folder": "store",
    "claim_ckpt_dir": "store",
    "latest_checkpoint": "store",
    "load_checkpoint": "store",
    "materialize_state_": "store",
    "read_meta": "store",
    "save_checkpoint": "store",
    "saved_steps": "store",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
