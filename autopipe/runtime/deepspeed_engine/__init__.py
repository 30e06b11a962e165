"""DeepSpeed's engine: the same layers in DeepSpeed's ``PipelineModule``, cut where the plan cuts,
trained by ``DeepSpeedTrainer`` with the torch engine's surface (and DeepSpeed's own checkpoints).

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "DSLayer": "module",
    "LayerSource": "module",
    "TiedHolder": "module",
    "build_pipeline_module": "module",
    "save_final_weights": "module",
    "parts_for": "parts",
    "planned_pipeline_module": "parts",
    "planned_pipeline_module_class": "parts",
    "CLIP_NOTE": "settings",
    "ds_config": "settings",
    "load_ds_config": "settings",
    "refuse_flags": "settings",
    "refuse_plan": "settings",
    "DeepSpeedBuild": "trainer",
    "DeepSpeedEnv": "trainer",
    "DeepSpeedTrainer": "trainer",
    "ds_latest_checkpoint": "trainer",
    "ds_resume": "trainer",
    "ds_save_checkpoint": "trainer",
    "train_deepspeed": "trainer",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
