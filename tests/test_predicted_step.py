"""One predicted step: convert's summary, the job's README, report.html's card and the step log show the
same figure (``Plan.predicted_step``, the whole step as the job runs it), and say beside it when the
profile behind it was noisy (issue 41)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from _factories import net_factory_source
from rich.console import Console

import autopipe
from autopipe.costs.layer_costs import DeviceInfo, Profile
from autopipe.costs.noise import noise_note
from autopipe.job.readme import job_readme
from autopipe.job.settings import JobSettings
from autopipe.planner import partition
from autopipe.report.page import render_report
from autopipe.report.predicted import step_figure, step_text
from autopipe.runtime.logs.steps import StepLogger, StepStats, predictions
from autopipe.units import format_time

CHECKOUT = Path(autopipe.__file__).resolve().parent.parent


def _profile(*, cores: int = 2, threads: int = 1, **noise: float) -> Profile:
    """Four layers of known cost measured on a CPU of ``cores`` cores, with the noise figures given."""
    prof = Profile.from_costs([0.01, 0.02, 0.02, 0.01], param_bytes=[1 << 20] * 4)
    return replace(prof, device=DeviceInfo(name="cpu", type="cpu", threads=threads, cores=cores), **noise)


def _log_line(plan, *, whole: float = 0.03) -> str:
    """The step log's line for one step of ``plan``'s own run, as rank 0 prints it to a file."""
    buf = io.StringIO()
    sp = plan.stage_plan()
    pred = predictions(sp, schedule=sp.schedule, microbatches=plan.microbatches, pp_size=plan.stages)
    log = StepLogger(0, predicted=pred, steps=2, console=Console(file=buf, width=300, highlight=False, soft_wrap=True))
    log.step(StepStats(step=1, loss=1.0, lr=1e-3, grad_norm=1.0, step_time=whole / 2, tokens_per_s=1.0,
                       stage_times=[whole / 2] * plan.stages, whole_step_time=whole))
    return buf.getvalue()


def test_the_runtime_promises_the_whole_step_on_shared_cores() -> None:
    """Two ranks profiled on one core share it: the step log's promise (StagePlan.step_time, the log's
    "plan" figure) is the plan's predicted step, the shared-core whole step, not the dedicated simulation."""
    plan = partition(_profile(cores=1), 2, microbatches=4)
    assert plan.shared_step_time is not None and plan.shared_step_time > plan.step_time  # what the test is about
    assert plan.stage_plan().step_time == plan.predicted_step == plan.total_step_time
    line = _log_line(plan)
    assert f"(plan {step_figure(plan)})" in line and "30 ms" in line  # the measured whole step beside it


@pytest.mark.parametrize("noise, words", [
    ({"timing_spread": 0.35}, "runs spread 35%"),
    ({"twin_ratio": 3.0}, "identical layers 3.0x apart"),
    ({"host_load": 3.9}, "load 3.9 on 2 cores"),  # 1 thread of its own on 2 cores: 2.9 cores of other work
])
def test_a_noisy_profile_is_said_beside_the_step_everywhere(noise: dict[str, float], words: str) -> None:
    """A profile whose runs spread, whose identical layers disagreed or that ran beside other work: the
    plan carries the words, and convert's line, the README, the report's card and the step log say them."""
    prof = _profile(**noise)
    plan = partition(prof, 2, microbatches=4)
    assert plan.profile_noise == noise_note(prof) == words
    settings = JobSettings(model="m", stages=2, microbatches=4, schedule=plan.schedule)
    for shown in (step_text(plan), job_readme(settings, prof, plan, "torchrun x"), render_report(plan, prof),
                  _log_line(plan)):
        assert f"noisy profile: {words}" in shown or ("noisy profile" in shown and words in shown), shown[:400]
    json_record = plan.stage_plan().step_noise
    assert json_record == words


def test_a_quiet_profile_says_nothing_beside_the_step() -> None:
    """Spread, twins and load under the thresholds (one layer's own spread small, load within the
    profiler's own thread and half a core): no note anywhere."""
    prof = _profile(timing_spread=0.05, twin_ratio=1.1, host_load=1.9)
    layers = [replace(l, forward_spread=0.0002, backward_spread=0.0002) for l in prof.layers]
    prof = replace(prof, layers=tuple(layers))
    plan = partition(prof, 2, microbatches=4)
    assert noise_note(prof) == "" and plan.profile_noise == ""
    settings = JobSettings(model="m", stages=2, microbatches=4, schedule=plan.schedule)
    for shown in (step_text(plan), job_readme(settings, prof, plan, "torchrun x"), render_report(plan, prof),
                  _log_line(plan)):
        assert "noisy profile" not in shown


def test_the_layers_own_spread_makes_a_profile_noisy() -> None:
    """The layers' interquartile ranges together over their times together, past 20%, are noise too."""
    prof = _profile()
    layers = [replace(l, forward_spread=0.3 * l.forward_time, backward_spread=0.3 * l.backward_time) for l in prof.layers]
    assert noise_note(replace(prof, layers=tuple(layers))) == "runs spread 30%"


def test_the_per_layer_chart_draws_the_times_the_stage_table_adds_up() -> None:
    """Each bar is its layer inside the whole model (its gaps included), so a chunk's bars add up to its
    row of the stage table (the layers timed alone, 3x slower here, are not what the plan sums)."""
    prof = Profile.from_costs([0.3, 0.3, 0.3, 0.3], forward_times=[0.1] * 4)
    prof = replace(prof, layers=tuple(replace(l, forward_gap=-0.07, backward_gap=-0.13) for l in prof.layers))
    plan = partition(prof, 2, microbatches=4)
    html = render_report(plan, prof)
    tips = re.findall(r"<title>layer \d+ \S+ \(stage (\d)\): backward ([^,]+), forward ([^<]+)</title>", html)
    assert len(tips) == 4
    assert {(b, f) for _, b, f in tips} == {(format_time(0.2 - 0.13), format_time(0.1 - 0.07))}
    assert plan.stage_forward[0] == pytest.approx(2 * 0.03) and plan.stage_backward[0] == pytest.approx(2 * 0.07)


@pytest.mark.slow  # converts a model in a process of its own and trains 2 steps on 2 ranks
def test_convert_readme_report_and_step_log_show_one_figure(tmp_path: Path, torchrun) -> None:
    """A job converted on one core for 2 ranks (so they share it): the step convert prints, the README's,
    report.html's card and a 2-step run's --log-json (and its line) are the same figure, the plan's
    predicted step; a noisy-profile note is in all of them or in none."""
    (tmp_path / "tiny.py").write_text(net_factory_source(batch_size=4))
    env = {**os.environ, "PYTHONPATH": str(CHECKOUT), "OMP_NUM_THREADS": "1"}
    one_core = min(os.sched_getaffinity(0))
    done = subprocess.run([sys.executable, "-m", "autopipe", "convert", "tiny.py:build", "--stages", "2",
                           "--schedule", "1f1b", "--repeats", "1", "--reserve", "0", "--out", "job"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: os.sched_setaffinity(0, {one_core}))
    assert done.returncode == 0, done.stdout + done.stderr
    job = tmp_path / "job"
    plan = autopipe.Plan.load(job / "plan.json")
    assert plan.shared_step_time is not None  # 2 ranks on the one core it was profiled on
    figure = step_figure(plan)
    said = " ".join(done.stdout.split())
    assert re.search(r"measured on .*?: step (\S+ \S+) \(", said).group(1) == figure
    readme = (job / "README.md").read_text()
    assert re.search(r"Predicted step time (\S+ \S+) \(", readme).group(1) == figure
    report = (job / "report.html").read_text()
    assert re.search(r"<span>predicted step</span><b>([^<]+)</b>", report).group(1) == figure

    ran = torchrun(job / "train.py", "--steps", 2, "--log-json", tmp_path / "log.json", nproc=2, cwd=job,
                   env={"PYTHONPATH": str(CHECKOUT)})
    records = [json.loads(line) for line in (tmp_path / "log.json").read_text().splitlines()]
    assert [r["predicted_step_time"] for r in records] == [plan.predicted_step] * 2
    assert ran.stdout.count(f"(plan {figure}") == 2

    noisy = [("noisy profile" in text) for text in (said, readme, report, ran.stdout)]
    assert noisy == [bool(plan.profile_noise)] * 4, (plan.profile_noise, noisy)
    assert all(r.get("predicted_step_noise", "") == plan.profile_noise for r in records)
