"""A CPU job whose ranks outnumber the cores: the plan's step counts the sharing (schedules.shared_step)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopipe import Profile
from autopipe.planner.partitioner import partition
from autopipe.planner.plan import Plan
from autopipe.planner.schedule_choice import plan_schedules
from autopipe.planner.schedules import SCHEDULES, shared_step, simulate


def _costs(schedule: str, ranks: int, seed: int) -> dict:
    v = 2 if schedule in ("interleaved1f1b", "zbv") else 1
    rng = np.random.default_rng(seed)
    k = ranks * v
    return dict(forward=rng.uniform(0.5, 2, k).tolist(), backward=rng.uniform(1, 4, k).tolist(),
                comm=rng.uniform(0, 0.2, k).tolist(), ranks=ranks, microbatches=2 * ranks)  # fmt: skip


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_enough_cores_is_the_dedicated_step_and_one_core_is_the_work(schedule: str) -> None:
    """With a core per rank the replay is the simulator's step; on one core it is every op's seconds
    added (one core never idles while an op is ready); in between it lies above both the dedicated
    step and the work over the cores."""
    for seed in range(3):
        c = _costs(schedule, 4, seed)
        sim = simulate(schedule, **c)
        assert shared_step(schedule, cores=4, **c) == pytest.approx(sim.step_time, rel=1e-9)
        assert shared_step(schedule, cores=1, **c) == pytest.approx(sum(sim.busy), rel=1e-9)
        two = shared_step(schedule, cores=2, **c)
        assert two >= max(sim.step_time, sum(sim.busy) / 2) * (1 - 1e-9)
        assert two <= sum(sim.busy) * (1 + 1e-9)


def _cpu(prof: Profile, cores: int) -> Profile:
    return replace(prof, device=replace(prof.device, type="cpu", cores=cores))


def test_a_cpu_plan_with_more_ranks_than_cores_predicts_the_shared_step(tmp_path) -> None:
    prof = Profile.from_costs([1.0] * 8)
    four = partition(_cpu(prof, 2), 4, microbatches=8, bandwidth=None)
    alone = partition(_cpu(prof, 0), 4, microbatches=8, bandwidth=None)  # a profile from before cores
    assert alone.cores == 0 and alone.shared_step_time is None and alone.total_step_time == alone.step_time
    assert four.boundaries == alone.boundaries and four.step_time == alone.step_time  # the cut is the same
    assert four.cores == 2 and four.total_step_time == four.shared_step_time
    assert four.shared_step_time == pytest.approx(shared_step("1f1b", forward=four.stage_forward, backward=four.stage_backward,
                                                              comm=four.stage_comm, ranks=4, microbatches=8, cores=2))  # fmt: skip
    assert four.shared_step_time > 1.3 * four.step_time  # 4 ranks on 2 cores: about the work over 2
    assert partition(_cpu(prof, 4), 4, microbatches=8, bandwidth=None).shared_step_time is None
    # dp replicas share the same cores: 2 stages x 2 replicas on 2 cores is 2 ranks on one core each
    dp = partition(_cpu(prof, 2), 2, microbatches=4, bandwidth=None, dp=2)
    assert dp.cores == 2 and dp.shared_step_time == pytest.approx(sum(dp.simulate().busy))
    gpu = replace(prof, device=replace(prof.device, type="cuda", cores=2))
    assert partition(gpu, 4, microbatches=8, bandwidth=None, memory_limit=None).shared_step_time is None
    four.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == four


def test_auto_chooses_the_schedule_by_the_step_on_the_shared_cores() -> None:
    """zbv's split backward costs more work than one backward (here 1.1x, as timed): with a core per
    rank its smaller bubble wins; with 4 ranks on 2 cores the other ranks fill the bubbles anyway and
    the work decides: zbv loses, even to 1F1B, as measured (bench/results/peers.md)."""
    prof = Profile.from_costs([1.0] * 8)
    layers = [replace(l, backward_input_time=0.4 * l.backward_time, backward_weight_time=0.7 * l.backward_time)
              for l in prof.layers]  # fmt: skip
    prof = replace(prof, layers=tuple(layers))
    own = plan_schedules(_cpu(prof, 4), 4, microbatches=8, bandwidth=None)
    shared = plan_schedules(_cpu(prof, 2), 4, microbatches=8, bandwidth=None)
    assert own.schedule == "zbv", own.why
    assert shared.schedule != "zbv" and shared.steps["zbv"] > shared.steps["1f1b"], shared.why
    assert shared.plan.schedule_steps == pytest.approx(shared.steps)
