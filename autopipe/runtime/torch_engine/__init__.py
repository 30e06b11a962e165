"""torch's engine: this rank's chunks under a torch.distributed.pipelining schedule, wrapped for
data parallelism (DDP, ``replicate``, FSDP2, ZeRO-1), and the ``Trainer`` that steps them.

The names below are imported on first use."""

from __future__ import annotations

from ...lazy import lazy_exports

_NAMES = {
    "PipelineEngine": "pipeline",
    "Stopwatch": "pipeline",
    "Trainer": "trainer",
    "DDP_BUCKET_CAP": "zero",
    "ZERO_STAGES": "zero",
    "ZeroOneAdamW": "zero_one",
    "bucket_bytes": "zero",
    "ddp_schedule": "zero",
    "explain_ddp_error": "zero",
    "shard_chunks_": "zero",
    "sharded_grads": "zero",
}
__all__ = sorted(_NAMES)
__getattr__ = lazy_exports(__name__, _NAMES, globals())
