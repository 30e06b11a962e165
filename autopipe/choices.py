"""The names a user picks from, each table written once: training precisions, engines, recompute
modes and policies, ZeRO stages, rank placements. No torch: the planner, the CLI, convert and the runtime read the
same tables, so a new choice is added in one place."""

from __future__ import annotations

from .errors import AutopipeError

__all__ = ["FUSED_ADAM_DEVICES", "PRECISIONS", "ENGINES", "RECOMPUTE_MODES", "RECOMPUTE_POLICIES", "ZERO_STAGES", "PLACEMENTS", "world_rank", "precision"]

# Training precision -> the torch dtype its matmuls run in (autocast; weights and optimizer state
# stay fp32). The profile measures the same.
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_PRECISION_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}

# Device types on which the runtime steps Adam/AdamW with torch's fused kernel (``fused=True``,
# torch >= 2.4 on a CPU): one pass over each tensor, no temporaries, where foreach's multi-tensor
# ops make a state-sized square root of every exp_avg_sq. Elsewhere it steps foreach. The memory
# model counts the step's temporaries only where foreach runs.
FUSED_ADAM_DEVICES = ("cpu", "cuda")

# What trains the job: torch.distributed.pipelining, or DeepSpeed's PipelineModule.
ENGINES = ("torch", "deepspeed")

# Activation recompute, per layer: "full" keeps only the layer's inputs and runs its forward again
# in backward; "selective" keeps the outputs of the expensive ops (matmuls, attention) and recomputes
# the cheap ones (pointwise, norms, softmax) in backward. "none" is the layer's own figures.
RECOMPUTE_MODES = ("none", "selective", "full")
# What a plan may choose per chunk: one mode everywhere, or "auto" (the fastest that fits).
RECOMPUTE_POLICIES = ("none", "auto", "selective", "full")

# Data-parallel sharding across a stage's replicas: 0 replicate, 1 + optimizer state, 2 + gradients,
# 3 + parameters.
ZERO_STAGES = (0, 1, 2, 3)

# How a (stages x replicas) layout numbers its world ranks (autopipe.cluster.topology says which links
# each gives): "pipeline-inner" puts a pipeline's stages on consecutive ranks (rank = replica * S +
# stage), "replica-inner" a stage's replicas (rank = stage * R + replica). torchrun fills a node with
# consecutive ranks, so this decides which groups stay inside a node.
PLACEMENTS = ("pipeline-inner", "replica-inner")


def world_rank(
    dp_rank: int, pp_rank: int, *, dp: int, pp: int, placement: str = "pipeline-inner", tp: int = 1, tp_rank: int = 0
) -> int:
    """The world rank of replica ``dp_rank``'s stage ``pp_rank`` (its tensor-parallel rank ``tp_rank``
    of ``tp``) under ``placement``. Tensor parallelism is innermost: a stage's tp ranks are consecutive,
    so they share a node (its fast links carry tp's per-layer collectives).

    >>> world_rank(1, 2, dp=2, pp=4), world_rank(1, 2, dp=2, pp=4, placement="replica-inner")
    (6, 5)
    >>> world_rank(1, 2, dp=2, pp=4, tp=2, tp_rank=1)
    13
    """
    if placement == "pipeline-inner":
        return (dp_rank * pp + pp_rank) * tp + tp_rank
    if placement == "replica-inner":
        return (pp_rank * dp + dp_rank) * tp + tp_rank
    raise AutopipeError(f"unknown placement {placement!r}; use one of {', '.join(PLACEMENTS)}.")


def precision(name: str) -> str:
    """fp32, bf16 or fp16 from any common spelling.

    >>> precision("bfloat16"), precision("FP16"), precision("float")
    ('bf16', 'fp16', 'fp32')
    """
    key = str(name).strip().lower()
    key = _PRECISION_ALIASES.get(key, key)
    if key not in PRECISIONS:
        raise AutopipeError(f"unknown dtype {name!r}; use fp32, bf16 or fp16.")
    return key
