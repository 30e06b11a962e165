"""The op orders torch's own pipeline schedules build: oracles for autopipe's copies of them."""

from __future__ import annotations


def torch_zbv_order(ranks: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The op order torch's own ScheduleZBVZeroBubble builds for one rank (the runtime runs it)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    names = {Kind.FORWARD: "F", Kind.BACKWARD_INPUT: "B", Kind.BACKWARD_WEIGHT: "W"}
    shape = SimpleNamespace(pp_group_size=ranks, num_stages=2 * ranks, _n_microbatches=m)
    ops = ScheduleZBVZeroBubble._calculate_single_rank_operations(shape, rank)
    return [(names[op.computation_type], op.microbatch_index, op.stage_index) for op in ops if op is not None]
