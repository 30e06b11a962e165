"""A profile at another micro-batch size, without profiling again. No torch.

The model (one function, so a re-profiling pass can replace it): a layer's forward, backward and
recompute seconds (its share of the whole model's gap too), the activations it saves, its transient peaks above its gradients, and the bytes it
passes on all scale linearly with the samples in a micro-batch; its parameters, gradients and
optimizer state do not. Linear time ignores that small micro-batches use an accelerator less well
(so it favours large ones no more than the hardware does, and small ones slightly more); linear
activations count autocast's per-micro-batch weight copies, which do not grow, as if they did (so
memory at a larger size is overstated, never understated).

Example:
    >>> from autopipe.costs.layer_costs import Profile
    >>> p = Profile.from_costs([1.0, 2.0], param_bytes=[10, 10], activation_bytes=[4, 4], output_bytes=[2, 0])
    >>> q = scale_microbatch(p, 3)
    >>> q.times, [l.activation_bytes for l in q.layers], [l.param_bytes for l in q.layers]
    ([3.0, 6.0], [12, 12], [10, 10])
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import PartitionError
from .layer_costs import LayerCost, Profile, RecomputeCost

__all__ = ["profiled_microbatch", "scale_microbatch", "tokens_per_sample"]


def profiled_microbatch(profile: Profile) -> int:
    """Samples per micro-batch the profile was taken at: the leading dimension of its first input (1 if unknown)."""
    for shape in profile.microbatch.values():
        if shape:
            return max(int(shape[0]), 1)
    return 1


def tokens_per_sample(profile: Profile) -> int | None:
    """Sequence length of a token model's sample (the first input's second dimension), else None."""
    for shape in profile.microbatch.values():
        return int(shape[1]) if len(shape) == 2 else None
    return None


def scale_microbatch(profile: Profile, samples: int) -> Profile:
    """``profile`` as if taken at ``samples`` per micro-batch (see the module docstring for the model)."""
    base = profiled_microbatch(profile)
    if samples < 1:
        raise PartitionError(f"a micro-batch needs at least 1 sample, got {samples}.")
    if samples == base:
        return profile
    k = samples / base

    def per_mb(x: int) -> int:
        return int(round(x * k))

    def layer(l: LayerCost) -> LayerCost:
        return replace(
            l, forward_time=l.forward_time * k, backward_time=l.backward_time * k,
            forward_gap=l.forward_gap * k, backward_gap=l.backward_gap * k,
            backward_input_time=l.backward_input_time * k, backward_weight_time=l.backward_weight_time * k,
            forward_spread=l.forward_spread * k, backward_spread=l.backward_spread * k,
            activation_bytes=per_mb(l.activation_bytes), peak_forward_bytes=per_mb(l.peak_forward_bytes),
            # the backward peak holds the layer's gradients (which do not grow) and temporaries (which do)
            peak_backward_bytes=l.grad_bytes + per_mb(max(l.peak_backward_bytes - l.grad_bytes, 0)),
            output_bytes=per_mb(l.output_bytes), flops=l.flops * k,
            recompute={m: RecomputeCost(per_mb(r.activation_bytes), r.extra_backward_time * k) for m, r in l.recompute.items()},
            weight_hold_bytes={m: per_mb(b) for m, b in l.weight_hold_bytes.items()},
        )  # fmt: skip

    shapes = {name: [samples, *shape[1:]] if shape else shape for name, shape in profile.microbatch.items()}
    return replace(profile, layers=tuple(layer(l) for l in profile.layers), microbatch=shapes,
                   input_bytes=per_mb(profile.input_bytes))  # fmt: skip
