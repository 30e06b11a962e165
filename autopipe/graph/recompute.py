"""Activation recompute, per layer: which tensors a layer keeps for backward and which it makes again.

Three modes (``autopipe.choices.RECOMPUTE_MODES``), chosen per pipeline chunk and applied to each of its layers:

- ``none``: autograd keeps what it always keeps.
- ``full``: the layer keeps only its inputs; backward runs its forward again first
  (``torch.utils.checkpoint``, non-reentrant). What DeepSpeed's ``activation_checkpoint_interval=1``
  and Megatron's ``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`` do.
- ``selective``: the layer keeps its inputs and the outputs of the expensive operators
  (:data:`SAVED_OPS`: matmuls by a weight, convolutions, fused attention kernels); backward
  recomputes the cheap rest (pointwise, norms, softmax, dropout, unfused attention) from them.
  torch's selective activation checkpointing (``create_selective_checkpoint_contexts``) with the
  policy :func:`keep_output`.

Why that split: a matmul by a weight (a linear layer: ``mm``/``addmm`` once its batch is folded into
rows) or a convolution does O(d) FLOPs per byte it writes, so recomputing it costs about as much time
as its forward did; a pointwise op, a norm or a softmax does O(1) per byte and is bound by memory
bandwidth, so recomputing it costs one more pass over data already there, while keeping its output
costs as many bytes as keeping its input. Fused attention kernels (flash, memory-efficient, cuDNN,
the CPU flash kernel) are kept: they are the most expensive operators of a transformer and their
output is small (they never materialise the (T, T) scores). Unfused attention multiplies activations
by activations with batched matmuls (``bmm``): QKᵀ writes b·h·T² scores, often the largest tensor
of the layer, at only O(head_dim) FLOPs per byte; those are recomputed with the softmax and dropout
over them — Megatron's selective recompute (recompute the core attention, keep the linear layers)
makes the same choice for the same reason.

Dropout replays the same masks: checkpoint saves the RNG state (CPU, and the inputs' device) before
the forward and restores it for the recomputation (``preserve_rng_state=True``), which leaves the
global RNG stream as it would be without recompute.

Zero-bubble schedules split a backward into an input-gradient pass (``stage_backward_input``) and a
later weight-gradient pass (``stage_backward_weight``), which makes one ``autograd.grad`` call per
group of weights (a transformer block has about six: each linear layer and norm). Non-reentrant
checkpoint recomputes once per autograd call, so the layer's forward runs 1 + (number of weight
groups) times instead of once: correct, memory as without the split, but slow (pytorch#136766 saw
the same interaction). torch's selective checkpoint also marks each kept output consumed at the first
recomputation and fails the second with "Trying to backward an extra time": :func:`run_layer` keeps
the outputs available until the layer's graph is freed (at the end of its backward rather than as
the first recomputation reads them), so every pass finds them. :func:`shared_recompute` around one
micro-batch's weight pass brings the count down to two (one for the input pass, one for all weight
groups); it cannot span both passes, because the nodes where input and weight paths meet run in
each and would unpack the same saved tensors twice, which ``GraphExecGroup`` refuses.

The profiler and the runtime run layers through the same :func:`run_layer`; the profiler passes
``on_keep`` to see what the selective policy keeps.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from ..choices import RECOMPUTE_MODES
from ..errors import AutopipeError

__all__ = [
    "RECOMPUTE_MODES", "SAVED_OPS", "RecomputeError", "check_mode", "chunk_modes", "keep_output", "run_layer",
    "shared_recompute",
]

_aten = torch.ops.aten

# Operators whose outputs ``selective`` keeps: the FLOP-heavy ones (see the module docstring). Packets,
# so every overload (mm.default, mm.out, ...) counts. Composite operators (linear, matmul, conv2d,
# scaled_dot_product_attention) never reach the policy: it sees what they dispatch to. bmm/baddbmm
# (batched activation x activation products: unfused attention) are left out on purpose.
SAVED_OPS: frozenset[Any] = frozenset(
    getattr(_aten, name)
    for name in (
        "mm", "addmm", "_int_mm", "_scaled_mm",  # 2-D matmuls: linear layers, a matmul by a weight
        "convolution", "_convolution", "convolution_overrideable",  # conv1d/2d/3d and transposed
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)  # some exist only in newer torch builds
)

KeepHook = Callable[[Tensor], None]


class RecomputeError(AutopipeError):
    """A recompute mode that does not exist, or that does not fit the plan it is given for."""


def check_mode(mode: str) -> str:
    """``mode`` if it is one of ``none``, ``selective``, ``full``; else a RecomputeError saying so."""
    if mode not in RECOMPUTE_MODES:
        raise RecomputeError(f"unknown recompute mode {mode!r}; use one of {', '.join(RECOMPUTE_MODES)}.")
    return mode


def chunk_modes(recompute: str | Sequence[str] | None, num_chunks: int, planned: Sequence[str] = ()) -> list[str]:
    """The recompute mode of each of ``num_chunks`` chunks.

    ``recompute`` is one mode for every chunk, or one per chunk; None (or ``"plan"``) takes the
    ``planned`` modes (the plan's, one per chunk) when there are any, else ``none`` everywhere.

    Example:
        >>> chunk_modes("full", 3)
        ['full', 'full', 'full']
        >>> chunk_modes(None, 2)
        ['none', 'none']
    """
    source = "recompute"
    if recompute is None or recompute == "plan":
        recompute = tuple(planned) or "none"
        source = "the plan's stage_recompute"
    if isinstance(recompute, str):
        return [check_mode(recompute)] * num_chunks
    modes = [check_mode(m) for m in recompute]
    if len(modes) != num_chunks:
        raise RecomputeError(
            f"{source} gives {len(modes)} modes but the plan has {num_chunks} chunks; give one mode for all "
            "chunks or one per chunk."
        )
    return modes


def keep_output(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective policy: keep the outputs of :data:`SAVED_OPS`, recompute everything else."""
    return CheckpointPolicy.MUST_SAVE if op.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _CountKept:
    """The forward-side context, telling ``on_keep`` each tensor it kept when the forward ends.

    Read from torch's cache rather than from the policy: torch <= 2.11 asks the policy before the
    operator runs, so the policy never sees the output.
    """

    def __init__(self, mode: Any, on_keep: KeepHook) -> None:
        self.mode, self.on_keep = mode, on_keep

    def __enter__(self) -> Any:
        return self.mode.__enter__()

    def __exit__(self, *exc: object) -> Any:
        try:
            return self.mode.__exit__(*exc)
        finally:
            for calls in self.mode.storage.values():
                for kept in (calls.values() if isinstance(calls, dict) else calls):
                    for leaf in tree_flatten(kept)[0]:
                        value = getattr(leaf, "val", None)  # torch's version-checking wrapper
                        if isinstance(value, Tensor):
                            self.on_keep(value)


class _Replayable:
    """torch's recompute-side selective context, made to serve more than one recomputation.

    torch marks each kept output consumed when a recomputation reads it, and refuses a second one.
    A zero-bubble schedule's weight-gradient pass is a second autograd call and recomputes again, so
    the kept outputs are put back after every recomputation; they are freed with the layer's graph.
    """

    def __init__(self, mode: Any) -> None:
        self.mode = mode
        self._entries: dict[Any, dict[int, Any] | list[Any]] = {}

    def __enter__(self) -> Any:
        # storage: op -> the kept values the forward side filled and torch's mode reads: a dict
        # call index -> value marked consumed when read (torch >= 2.12), or a list popped from the
        # front (torch <= 2.11); a copy of either puts it back
        self._entries = {op: _copy_calls(calls) for op, calls in self.mode.storage.items()}
        return self.mode.__enter__()

    def __exit__(self, *exc: object) -> Any:
        try:
            return self.mode.__exit__(*exc)
        finally:
            for op, calls in self._entries.items():
                if isinstance(calls, dict):
                    self.mode.storage[op].update(calls)
                else:
                    self.mode.storage[op][:] = calls
            self._entries = {}


def _copy_calls(calls: Any) -> dict[int, Any] | list[Any]:
    return dict(calls) if isinstance(calls, dict) else list(calls)


def _selective_contexts(on_keep: KeepHook | None) -> tuple[Any, Any]:
    forward_side, recompute_side = create_selective_checkpoint_contexts(keep_output)
    if not isinstance(getattr(recompute_side, "storage", None), dict):
        # _Replayable reads torch's cache; a torch that keeps it elsewhere would fail mid-backward
        raise RecomputeError(
            f"selective recompute does not know torch {torch.__version__}'s selective-checkpoint cache; "
            "use recompute 'full' (or 'none')."
        )
    return (forward_side if on_keep is None else _CountKept(forward_side, on_keep)), _Replayable(recompute_side)


def run_layer(layer: nn.Module, x: Any, mode: str, *, on_keep: KeepHook | None = None) -> Any:
    """``layer(x)`` under recompute ``mode``: the one way the runtime and the profiler run a layer.

    ``x`` is a Tensor or a tuple of Tensors (the layer format). Without grad mode (shape inference,
    evaluation) nothing is kept, so every mode runs the layer plainly.

    Example:
        >>> import torch
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(2, 8, requires_grad=True)
        >>> run_layer(block, x, "selective").sum().backward()  # recomputes the GELU, keeps the matmul's output
        >>> recomputed, x.grad = x.grad, None
        >>> block(x).sum().backward()
        >>> torch.allclose(recomputed, x.grad)
        True
    """
    if mode == "none" or not torch.is_grad_enabled():
        return layer(x)
    check_mode(mode)
    packed = isinstance(x, tuple)
    args = x if packed else (x,)

    def forward(*xs: Tensor) -> Any:
        return layer(tuple(xs) if packed else xs[0])

    if mode == "full":
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(
        forward, *args, use_reentrant=False, preserve_rng_state=True,
        context_fn=functools.partial(_selective_contexts, on_keep),
    )


def shared_recompute() -> contextlib.AbstractContextManager[Any]:
    """Backward calls made inside recompute each checkpointed layer at most once between them.

    For a zero-bubble schedule's weight pass of one micro-batch (``stage_backward_weight`` makes one
    autograd call per weight group, each of which would recompute the layer again). The calls inside
    must not need the same saved tensors: a weight pass's groups never do; an input pass and its
    weight pass do, so they are wrapped separately. A no-op where torch has no ``GraphExecGroup``.

    Example:
        >>> import torch
        >>> class TwoHeads(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return self.a(x), self.b(x)
        >>> layer, runs = TwoHeads(), []
        >>> hook = layer.register_forward_pre_hook(lambda *_: runs.append(1))
        >>> ya, yb = run_layer(layer, torch.randn(2, 4, requires_grad=True), "full")
        >>> with shared_recompute():  # one backward call per weight group, as a weight pass makes them
        ...     grads_a = torch.autograd.grad(ya.sum(), list(layer.a.parameters()))
        ...     grads_b = torch.autograd.grad(yb.sum(), list(layer.b.parameters()))
        >>> len(runs)  # the forward, then one recomputation for both calls (not one each)
        2
    """
    group = getattr(torch.utils.checkpoint, "GraphExecGroup", None)
    return group() if group is not None else contextlib.nullcontext()
