"""Plans per engine: the engine's measured overheads in the cost model, exact cuts for that model,
``--engine auto`` and ``plan --compare`` (each engine's best plan), and one-line refusals."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

import autopipe.costs.engines as engines_mod
from autopipe import Profile
from autopipe.cli import app
from autopipe.costs.engines import EngineCosts, engine_costs
from autopipe.errors import AutopipeError
from autopipe.job.script import read_settings
from autopipe.job.settings import ConvertSettings
from autopipe.planner.cost_model import CostModel
from autopipe.planner.engine_choice import plan_engines
from autopipe.planner.partitioner import compare_baselines, partition
from autopipe.planner.schedules import simulate

runner = CliRunner()

# made-up figures for the tests (the real table is measured by bench/bench_engines.py)
TORCH = dict(per_op=0.004, send_latency=0.002, bandwidth=1e6, per_step=0.010, optimizer_rate=1e-9)
DEEPSPEED = dict(per_op=0.001, send_latency=0.001, bandwidth=1e6, per_step=0.020, optimizer_rate=1e-9)


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "engine_costs.json"
    rows = {e: {"engine": e, "device": "cpu", "source": "test", **f} for e, f in (("torch", TORCH), ("deepspeed", DEEPSPEED))}
    path.write_text(json.dumps({"devices": {"cpu": rows}}))
    monkeypatch.setattr(engines_mod, "TABLE", path)
    return path


def _profile() -> Profile:
    # a large output after layer 3 (where the layers alone cut in two) and small ones elsewhere: a slow
    # link moves the cut
    times = [0.02, 0.05, 0.05, 0.05, 0.06, 0.05, 0.04]
    outputs = [4000, 4000, 4000, 200_000, 4000, 4000, 0]
    return Profile.from_costs(times, param_bytes=[4_000_000] * 7, activation_bytes=[1000] * 7, output_bytes=outputs)


def _brute_force(prof: Profile, stages: int, m: int, costs: EngineCosts) -> tuple[float, tuple[int, ...]]:
    """The least simulated step over every cut, each chunk costed by the engine's model."""
    model = CostModel(prof, None, costs.bandwidth, "1f1b", m, engine=costs)
    c, n = model.costs, len(prof.layers)
    best = (float("inf"), ())
    for inner in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *inner, n)
        a, b = np.array(bounds[:-1]), np.array(bounds[1:])
        step = simulate("1f1b", forward=c.forward(a, b).tolist(), backward=c.backward(a, b).tolist(),
                        comm=c.comm(a, b).tolist(), ranks=stages, microbatches=m).step_time  # fmt: skip
        best = min(best, (step, bounds))
    return best


@pytest.mark.parametrize("stages", [2, 3])
def test_engine_plan_is_exact_for_its_cost_model(table, stages) -> None:
    """partition(engine=...) finds the best cut under that engine's per-op, per-send and link terms
    (brute force over every cut agrees), and those terms change the cut the layers alone pick."""
    prof = _profile()
    for engine in ("torch", "deepspeed"):
        costs = engine_costs(engine, "cpu")
        assert costs is not None and costs.per_op == {"torch": TORCH, "deepspeed": DEEPSPEED}[engine]["per_op"]
        plan = partition(prof, stages, microbatches=4, recompute="none", engine=engine)
        step, bounds = _brute_force(prof, stages, 4, costs)
        assert plan.engine == engine
        assert plan.step_time == pytest.approx(step, rel=1e-12)
        assert _brute_force(prof, stages, 4, costs)[0] <= plan.step_time * (1 + 1e-12)
        # the whole step adds the slowest rank's norm + optimizer step after the schedule
        held = max(sum(CostModel(prof, None, None).param_counts[a:b]) for a, b in zip(plan.boundaries, plan.boundaries[1:]))
        assert plan.step_overhead == pytest.approx(costs.per_step + costs.optimizer_rate * held)
        assert plan.total_step_time == pytest.approx(plan.step_time + plan.step_overhead)
        # the baselines beside it are costed for the same engine
        assert {p.engine for p in compare_baselines(prof, plan).values()} == {engine}
    alone = partition(prof, 2, microbatches=4, recompute="none")
    assert alone.engine == "" and alone.step_overhead == 0.0
    assert partition(prof, 2, microbatches=4, recompute="none", engine="torch").boundaries != alone.boundaries


def test_compute_scale_stretches_the_layers_not_the_sends() -> None:
    """An engine's compute_scale (its layers' seconds in a job over the profiled ones) multiplies every
    layer's forward, backward and recompute time, and nothing else: with no per-op, send or link
    terms a scale of 2 doubles the simulated step exactly; a table written before the field reads 1."""
    prof = _profile()
    flat = dict(per_op=0.0, send_latency=0.0, bandwidth=None, per_step=0.0, optimizer_rate=0.0, source="test")
    one = partition(prof, 3, microbatches=4, recompute="none", bandwidth=None, engine=EngineCosts("torch", "cpu", **flat))
    two = partition(prof, 3, microbatches=4, recompute="none", bandwidth=None,
                    engine=EngineCosts("torch", "cpu", compute_scale=2.0, **flat))
    assert two.boundaries == one.boundaries
    assert two.step_time == pytest.approx(2 * one.step_time, rel=1e-12)
    assert two.stage_forward == pytest.approx([2 * f for f in one.stage_forward], rel=1e-12)
    full = partition(prof, 3, microbatches=4, recompute="full", bandwidth=None,
                     engine=EngineCosts("torch", "cpu", compute_scale=2.0, **flat))
    assert full.stage_recompute_time == pytest.approx([2 * f for f in one.stage_forward], rel=1e-12)
    # a send is the link's, not the layers': scaling the layers leaves it as it was
    linked = dict(flat, bandwidth=1e6, send_latency=0.002)
    assert CostModel(prof, None, 1e6, "1f1b", 4, engine=EngineCosts("torch", "cpu", compute_scale=3.0, **linked)).one_way \
        == CostModel(prof, None, 1e6, "1f1b", 4, engine=EngineCosts("torch", "cpu", **linked)).one_way
    assert EngineCosts(**{"engine": "torch", "device": "cpu", **flat}).compute_scale == 1.0


def test_a_table_fitted_on_another_host_scales_its_per_call_seconds_by_the_profile_s_probe(tmp_path, monkeypatch) -> None:
    """A table records the host probe of the machine it was fitted on; a profile from a host whose probe
    took twice as long plans with twice the per-op, per-step and latency seconds (the step exactly as
    a table holding those figures would give) and the same bandwidths and optimizer rate; a profile
    without the probe (older ones) plans with the table as fitted."""
    path = tmp_path / "engine_costs.json"
    row = {"engine": "torch", "device": "cpu", "source": "test", "host_probe": 0.004, "allreduce_latency": 1e-3,
           "allreduce_bandwidth": 1e8, **TORCH}
    path.write_text(json.dumps({"devices": {"cpu": {"torch": row}}}))
    monkeypatch.setattr(engines_mod, "TABLE", path)
    prof = _profile()
    slow = replace(prof, device=replace(prof.device, type="cpu", host_probe=0.008))
    doubled = EngineCosts(**{**row, "per_op": 2 * TORCH["per_op"], "per_step": 2 * TORCH["per_step"],
                             "send_latency": 2 * TORCH["send_latency"], "allreduce_latency": 2e-3,
                             "host_probe": 0.008})  # fitted on the slow host: nothing to scale
    for stages in (2, 3):
        scaled = partition(slow, stages, microbatches=4, recompute="none", engine="torch")
        by_hand = partition(slow, stages, microbatches=4, recompute="none", engine=doubled)
        assert scaled.boundaries == by_hand.boundaries
        assert scaled.step_time == pytest.approx(by_hand.step_time, rel=1e-12)
        assert scaled.step_overhead == pytest.approx(by_hand.step_overhead, rel=1e-12)
        as_fitted = partition(prof, stages, microbatches=4, recompute="none", engine="torch")
        assert as_fitted.step_time < scaled.step_time and as_fitted.step_overhead < scaled.step_overhead
    on_slow = engine_costs("torch", "cpu").on_host(0.008)
    assert (on_slow.bandwidth, on_slow.optimizer_rate, on_slow.allreduce_bandwidth) == (1e6, 1e-9, 1e8)
    assert on_slow.allreduce_time(10**6) == pytest.approx(2e-3 + 2 * 10**6 / 2 / 1e8 * 1)  # 2(n-1)/n = 1 for two


def test_the_host_probe_times_per_op_host_work() -> None:
    """The probe is the host's per-operator work: with a Python hook on every torch call (more host work
    per op, no more arithmetic) it reads longer; a CPU profile's device records it."""
    import time

    import torch
    from torch.overrides import TorchFunctionMode

    from autopipe.costs.devices import describe_device, host_probe

    spin = 50e-6  # host work added per torch call
    calls = [0]

    class Slower(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls[0] += 1
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < spin:
                pass
            return func(*args, **(kwargs or {}))

    plain = min(host_probe() for _ in range(3))  # the least of 3: a neighbour's burst on the shared cores inflates one
    with Slower():
        hooked = min(host_probe() for _ in range(3))
    # judged by the host work the hook added to one timed run, not by a ratio to the plain run: a slower
    # host (CI's read 8 ms plain, three times this one's) makes any fixed ratio a coin toss
    added = calls[0] / (3 * 8) * spin  # each probe runs its work 8 times (a warm-up and 7 timed)
    assert plain > 0 and added > 0 and hooked - plain > 0.8 * added, (plain, hooked, added)
    assert describe_device(torch.device("cpu")).host_probe > 0
    with torch.inference_mode():  # a caller's mode does not change what it times
        assert host_probe() > 0
    with torch.no_grad():
        assert host_probe() > 0


def test_auto_picks_the_faster_engine_and_says_why_not(table) -> None:
    """plan_engines plans each engine, picks the least whole step, and skips what cannot run."""
    prof = _profile()
    choice = plan_engines(prof, 2, microbatches=4, importable=lambda name: True)
    steps = {e: p.total_step_time for e, p in choice.plans}
    assert set(steps) == {"torch", "deepspeed"} and choice.engine == min(steps, key=steps.get)
    assert choice.plan.engine == choice.engine and "predicted whole step" in choice.why
    zbv = plan_engines(prof, 2, microbatches=4, schedule="zbv", importable=lambda name: True)
    assert zbv.engine == "torch" and "--schedule zbv does not run on --engine deepspeed" in dict(zbv.skipped)["deepspeed"]
    missing = plan_engines(prof, 2, microbatches=4, importable=lambda name: False)
    assert missing.engine == "torch" and "not installed" in dict(missing.skipped)["deepspeed"]


def test_no_table_entry_means_the_layers_alone(tmp_path, monkeypatch) -> None:
    """A device the table has not measured gets no engine terms (a plan as before)."""
    monkeypatch.setattr(engines_mod, "TABLE", tmp_path / "none.json")
    prof = _profile()
    assert engine_costs("torch", "cpu") is None
    plan = partition(prof, 2, microbatches=4, recompute="none", engine="torch")
    alone = partition(prof, 2, microbatches=4, recompute="none")
    assert plan.step_time == alone.step_time and plan.boundaries == alone.boundaries and plan.step_overhead == 0.0


def test_plan_cli_engine_auto_and_compare(table, tmp_path) -> None:
    """`plan --engine auto` plans for the faster engine; `--compare` shows both engines' plans."""
    path = tmp_path / "profile.json"
    _profile().save(path)
    result = runner.invoke(app, ["plan", str(path), "-s", "2", "-m", "4", "--engine", "auto", "--json"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    chosen = data["engines"]["chosen"]
    assert data["plan"]["engine"] == chosen
    totals = {e: p["step_time"] + p["step_overhead"] for e, p in data["engines"]["plans"].items()}
    assert chosen == min(totals, key=totals.get)
    result = runner.invoke(app, ["plan", str(path), "-s", "2", "-m", "4", "--compare"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "engines: each one's best plan" in out and "torch" in out and "deepspeed" in out


def test_bad_engine_is_one_short_error(table, tmp_path) -> None:
    path = tmp_path / "profile.json"
    _profile().save(path)
    result = runner.invoke(app, ["plan", str(path), "-s", "2", "--engine", "tensorflow"], env={"COLUMNS": "200"})
    assert result.exit_code != 0
    assert "unknown engine 'tensorflow'; use one of torch, deepspeed, auto." in " ".join(result.output.split())
    assert "Traceback" not in result.output
    with pytest.raises(AutopipeError, match="unknown engine 'tf'"):
        ConvertSettings(stages=2, engine="tf")
    assert ConvertSettings(stages=2, engine="AUTO", schedule="zbv").engine == "auto"  # auto refuses nothing itself


def test_convert_engine_auto_writes_the_faster_engines_job(table, tmp_path, monkeypatch) -> None:
    """`convert --engine auto` trains on the engine whose plan predicts the shorter whole step and
    says so (what DeepSpeed cannot run is skipped with why: test_auto_picks_the_faster_engine...)."""
    from _factories import net_factory_source

    (tmp_path / "tiny.py").write_text(net_factory_source(batch_size=4))
    monkeypatch.chdir(tmp_path)
    args = ["convert", "tiny.py:build", "--stages", "2", "--estimate", "--microbatches", "4", "--engine", "auto"]
    result = runner.invoke(app, [*args, "--out", "auto"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    plan = json.loads((tmp_path / "auto" / "plan.json").read_text())
    line = next(l for l in result.output.splitlines() if l.startswith("engine "))
    steps = dict(re.findall(r"(torch|deepspeed) ([0-9.]+) s", line))
    assert set(steps) == {"torch", "deepspeed"} and plan["engine"] == min(steps, key=lambda e: float(steps[e]))
    assert read_settings(tmp_path / "auto" / "train.py")["engine"] == plan["engine"]


@pytest.mark.shipped_engine_table
def test_the_shipped_table_is_physical_and_costs_cpu_plans() -> None:
    """The table bench_engines.py adopted (only on a quiet machine, its fit within 5 % of every measured
    step) holds no negative or absurd figure, says where it came from, and a CPU plan counts it: the
    layers stretched by compute_scale, the after-schedule terms in the whole step."""
    table = engines_mod.load_table()
    assert table, "autopipe/costs/engine_costs.json is missing or empty"
    for device, rows in table.items():
        assert set(rows) <= {"torch", "deepspeed"}
        for costs in rows.values():
            assert costs.device == device and "bench_engines.py" in costs.source
            assert costs.per_op >= 0 and costs.per_step >= 0 and costs.send_latency >= 0
            assert 1e8 < costs.bandwidth < 1e12 and 0 < costs.optimizer_rate < 1e-7
            assert 0.8 <= costs.compute_scale <= 2.0
            assert costs.allreduce_bandwidth is None or (1e7 < costs.allreduce_bandwidth < 1e12 and costs.allreduce_latency >= 0)
    cpu = table["cpu"]["torch"]
    prof = _profile()
    plan = partition(prof, 2, microbatches=4, recompute="none", engine="torch")
    alone = partition(prof, 2, microbatches=4, recompute="none", bandwidth=cpu.bandwidth, boundaries=plan.boundaries)
    assert plan.stage_forward == pytest.approx([f * cpu.compute_scale for f in alone.stage_forward])
    assert plan.step_overhead > 0 and plan.total_step_time == pytest.approx(plan.step_time + plan.step_overhead)


_TORCH_1F1B = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
stage = PipelineStage(torch.nn.Linear(2, 2), 0, 4, torch.device("cpu"))
try:
    Schedule1F1B(stage, 2)
except ValueError as e:
    print("refused:", e)
"""


def test_1f1b_with_fewer_micro_batches_than_stages_is_refused_for_torch_only() -> None:
    """torch's Schedule1F1B refuses M < S when the job starts (checked here on torch itself), so a
    plan for torch's engine refuses it in one line; DeepSpeed's 1F1B runs it, and --schedule auto
    skips 1F1B with the reason and plans another."""
    import subprocess
    import sys

    from autopipe.errors import PartitionError
    from autopipe.planner.schedule_choice import plan_schedules

    done = subprocess.run([sys.executable, "-c", _TORCH_1F1B], capture_output=True, text=True, timeout=120)
    assert "refused: Number of microbatches (2)" in done.stdout, done.stdout + done.stderr
    prof = Profile.from_costs([1, 2, 2, 2, 2, 1])
    with pytest.raises(PartitionError, match=r"1f1b on torch's engine needs at least as many micro-batches as stages \(2 < 4\)"):
        partition(prof, 4, microbatches=2, schedule="1f1b", engine="torch", bandwidth=None)
    assert partition(prof, 4, microbatches=2, schedule="1f1b", engine="deepspeed", bandwidth=None).schedule == "1f1b"
    choice = plan_schedules(prof, 4, microbatches=2, engine="torch", bandwidth=None)
    assert choice.schedule != "1f1b" and choice.plan.schedule == choice.schedule
    assert any(s == "1f1b" and "at least as many micro-batches" in why for s, why in choice.skipped), choice.skipped
