"""Megatron-Core: ``--pipeline-model-parallel-layout`` and the flags it implies, for decoder language models.

The layout lists the virtual stages in order (stage i runs on rank ``i % pp``, virtual stage
``i // pp``; Megatron derives the virtual-stage count from the length, so no
``--num-layers-per-virtual-pipeline-stage`` beside it), stages split by ``|``: ``E`` the embedding,
``t`` a decoder layer, ``L`` the final norm, output layer and loss. ``t*3`` repeats a symbol and
``(tt|)*4`` a run of stages; commas are cosmetic. The layers of the flattened model map to E/t/L by
autopipe.planner.targets.decoder_stack (the numbered blocks are t).

Example:
    >>> megatron_layout([(1, 3, 0), (0, 4, 0), (0, 4, 0), (0, 4, 0), (0, 1, 1)])
    'Et*3|(t*4|)*3,t,L'
"""

from __future__ import annotations

from ...planner.targets import decoder_stack
from .modules import StageModules

__all__ = ["megatron_layout", "megatron_stage_symbols", "megatron_args"]


def megatron_stage_symbols(sm: StageModules) -> list[tuple[int, int, int]]:
    """Per chunk (E?, decoder layers, L?) as counts: what its stage string says."""
    stack = decoder_stack(sm.names)
    # E is the first chunk's and L the last's: a plan that cuts inside either is refused before this
    return [(int(a == 0), sum(stack.blocks[a:b]), int(b == len(sm.names))) for a, b in sm.layers]


def _stage(e: int, t: int, loss: int) -> str:
    body = "E" * e + ("t" if t == 1 else f"t*{t}" if t > 1 else "")
    if loss:
        body += ("," if body else "") + "L"
    return body


def megatron_layout(symbols: list[tuple[int, int, int]]) -> str:
    """The layout string of per-stage (E, t, L) counts, runs of three or more equal stages grouped."""
    stages = [_stage(*s) for s in symbols]
    out, i = "", 0
    while i < len(stages):
        j = i
        while j < len(stages) and stages[j] == stages[i]:
            j += 1
        run = j - i
        last = j == len(stages)
        if run >= 3 and not last:  # "(s|)*n" ends with its own "|"; a comma sets the next stage apart
            out += f"({stages[i]}|)*{run},"
        else:
            out += "|".join(stages[i:j]) + ("" if last else "|")
        i = j
    return out


def megatron_args(sm: StageModules) -> list[str]:
    """The command-line flags (pretrain_gpt.py's) for this plan."""
    symbols = megatron_stage_symbols(sm)
    decoder = sum(t for _, t, _ in symbols)
    flags = [
        f"--tensor-model-parallel-size {sm.tp}",
        f"--pipeline-model-parallel-size {sm.stages}",
        f"--pipeline-model-parallel-layout \"{megatron_layout(symbols)}\"",
        f"--num-layers {decoder}",
        f"--micro-batch-size {sm.microbatch_size}",
        f"--global-batch-size {sm.microbatch_size * sm.microbatches * sm.dp}",
    ]
    if sm.sequence_parallel:
        flags.append("--sequence-parallel")
    if sm.ep > 1 or sm.experts:  # each rank holds experts/ep experts, as the plan counts them (ep 1: all)
        flags += [f"--expert-model-parallel-size {sm.ep}", f"--num-experts {sm.experts}", f"--moe-router-topk {sm.top_k}"]
        if sm.tp > 1:
            # the plan keeps each expert whole on a tp rank (autopipe runs the experts whole on each tp rank,
            # beside the sharded attention, or under ep the whole MoE layer replicated over tp), where
            # Megatron's default splits experts tp ways; with 1, its ep groups take a replica's tp ranks first
            # (consecutive ranks, inside a node) where autopipe's take one tp rank of ep replicas: the same
            # experts per rank, the all-to-alls over other (nearer) ranks
            flags.append("--expert-tensor-parallel-size 1")
    if not sm.tied:
        flags.append("--untie-embeddings-and-output-weights")
    if sm.dp > 1 and sm.zero in (1, 2):
        flags.append("--use-distributed-optimizer")
    if sm.recompute == "full":
        flags += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif sm.recompute == "selective":
        flags.append("--recompute-granularity selective")
    return flags
