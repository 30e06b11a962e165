"""What a job trains on: the model's factory and example batch, the data files, the batches
cut into micro-batches, and the loss.

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "batch_tokens": "batches",
    "pack_batch": "batches",
    "split_batch": "batches",
    "ModelSource": "factory",
    "model_factory": "factory",
    "DataError": "files",
    "check_data_path": "files",
    "LOSSES": "losses",
    "LossError": "losses",
    "check_loss": "losses",
    "cross_entropy": "losses",
    "is_model_loss": "losses",
    "loss_name": "losses",
    "make_loss": "losses",
    "model_loss": "losses",
    "model_outputs_logits": "losses",
    "mse": "losses",
    "resolve_loss": "losses",
    "scalar_outputs": "losses",
    "SampleData": "sources",
    "TokenData": "sources",
    "TokenStream": "sources",
    "epoch_order": "sources",
    "open_data": "sources",
    "JobData": "tasks",
    "LABEL_NAMES": "tasks",
    "mlm_mask": "tasks",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
