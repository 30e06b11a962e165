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
    "CheckpointFolderError": "folders",
    "check_ckpt_dir": "folders",
    "checkpoint_dirs": "folders",
    "claim_ckpt_dir": "folders",
    "latest_checkpoint": "folders",
    "read_meta": "folders",
    "saved_steps": "folders",
    "ResumeError": "resume",
    "resume": "resume",
    "check_shared_folder": "store",
    "load_checkpoint": "store",
    "materialize_state_": "store",
    "save_checkpoint": "store",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
