"""Progress a person sees: profiling, the reserve probe and the cluster search report phases with the
time left, shown live on a terminal and as plain lines elsewhere; the library keeps quiet when asked;
convert's first launch line is a short `autopipe run` (issue 41)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import torch
from _factories import net_factory_source
from typer.testing import CliRunner

import autopipe
from autopipe.cli import app
from autopipe.cluster.layout_search import search
from autopipe.cluster.topology import cluster_for
from autopipe.costs.layer_costs import Profile
from autopipe.progress import Lines, Live, Progress, Quiet, progress_for
from autopipe.runtime.checks import reserve


class _Clock:
    """A clock that moves only when told: the tests' seconds are exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_lines_say_each_phase_with_the_time_left_and_no_more_often_than_asked() -> None:
    """A line each time `every` seconds have passed (with the time left from the pace of the work done,
    weighted), and one at the end with the time it took; a phase over sooner says nothing."""
    out, clock = io.StringIO(), _Clock()
    shown = Lines(out, every=10.0, clock=clock)
    with shown.phase("profile", total=4, unit="layers measured", total_work=10.0) as phase:
        clock.now = 2.0
        phase.advance(work=1.0)  # 2 s after the start: too soon for a line
        clock.now = 20.0
        phase.advance(work=4.0)  # 5 of 10 work units in 20 s: 20 s left
        clock.now = 25.0
        phase.advance(work=0.5)  # 5 s after the last line: none
        clock.now = 30.0
        phase.advance(work=4.5)
    with shown.phase("partition", total=2, unit="schedules planned") as phase:
        clock.now = 31.0
        phase.advance(2)  # over in 1 s: nobody waited, nothing said (a refusal after it stays one line)
    assert out.getvalue().splitlines() == [
        "profile: 2/4 layers measured, ~20 s left",
        "profile: 4/4 layers measured in 30 s",
    ]


def test_a_phase_that_ends_early_says_why_and_one_without_a_total_says_how_long() -> None:
    out, clock = io.StringIO(), _Clock()
    shown = Lines(out, every=0.0, clock=clock)
    with shown.phase("search", total=40, unit="layouts solved") as phase:
        clock.now = 3.0
        phase.advance()
        phase.finish("the other 39 cannot beat the best 3")
    with shown.phase("reserve: profile a probe model") as phase:
        clock.now = 8.0
    assert out.getvalue().splitlines()[-3:] == [
        "search: 1/40 layouts solved (the other 39 cannot beat the best 3) in 3 s",
        "reserve: profile a probe model: running",
        "reserve: profile a probe model: running in 5 s",
    ]


def test_the_display_is_chosen_once_by_where_it_goes() -> None:
    """A terminal gets the live bar, anything else plain lines, False nothing, and a display given is used."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert isinstance(progress_for(True, Terminal()), Live)
    assert isinstance(progress_for(True, io.StringIO()), Lines)
    assert isinstance(progress_for(False), Quiet)
    mine = Lines(io.StringIO())
    assert progress_for(mine) is mine


def _tiny_net():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()

    return Net(), torch.randn(4, 8)


def test_profile_reports_its_layers_and_the_whole_model_and_is_quiet_when_asked(capsys: pytest.CaptureFixture) -> None:
    """The layers phase counts every layer (the identical ones weigh less), then the whole model's runs;
    progress=False writes nothing at all."""
    model, x = _tiny_net()
    seq = autopipe.flatten(model, (x,))
    out = io.StringIO()
    autopipe.profile(seq, (x,), repeats=2, progress=Lines(out, every=0.0))
    said = out.getvalue().splitlines()
    n = len(seq.layers)
    assert re.fullmatch(rf"profile: 1/{n} layers measured, ~\d+ s left", said[0]), said
    end = next(i for i, line in enumerate(said) if re.fullmatch(rf"profile: {n}/{n} layers measured in \d+ s", line))
    assert any(re.fullmatch(rf"profile: 1/{n} layers measured, ~\d+ s left", line) for line in said[:end]), said
    assert said[end + 1].startswith("profile: the whole model: 1/") and re.fullmatch(
        r"profile: the whole model: (\d+)/\1 runs in \d+ s", said[-1]), said
    capsys.readouterr()
    autopipe.profile(seq, (x,), repeats=2, progress=False)
    assert capsys.readouterr() == ("", "")


def test_the_search_reports_the_layouts_it_solves() -> None:
    """The cluster search (torch-free: it only calls the display it is given) counts the layouts it solves
    and, when it stops early, says the rest cannot beat the best."""
    out = io.StringIO()
    prof = Profile.from_costs([1.0] * 8, param_bytes=[100] * 8, activation_bytes=[10] * 8)
    result = search(prof, cluster_for("cpu", 8, 8), global_batch=16, memory_limit=None, progress=Lines(out, every=0.0))
    said = out.getvalue().splitlines()
    total = result.solved + result.pruned_bound
    assert said[0].startswith(f"search: 1/{total} layouts solved, ~")
    assert said[-1].startswith(f"search: {result.solved}/{total} layouts solved")
    if result.pruned_bound:
        assert f"(the other {result.pruned_bound} cannot beat the best 3)" in said[-1]


def test_the_reserve_probe_counts_its_ranks_steps_as_they_write_them(tmp_path: Path) -> None:
    """The probe's ranks run in processes of their own and write their step count after each step; the
    asking process shows the slowest rank's count while they run."""
    seen: list[int] = []

    class Record(Progress):
        def _changed(self, phase) -> None:
            seen.append(phase.done)

    with Record().phase("reserve: train the probe", total=10, unit="steps") as phase:
        with reserve._watching(tmp_path, 2, phase):
            (tmp_path / "step0").write_text("4")
            (tmp_path / "step1").write_text("3")
    assert seen and seen[-1] == 3 and phase.done == 3


def test_convert_says_the_short_run_first_and_torchrun_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """convert's launch lines are `autopipe run JOB --steps 8` then the torchrun line; the job's README
    gives them in that order."""
    (tmp_path / "tiny.py").write_text(net_factory_source(batch_size=4))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["convert", "tiny.py:build", "--stages", "2", "--estimate", "--reserve", "0",
                                      "--schedule", "1f1b", "--out", "job"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    launch = lines[lines.index("launch:") + 1:]
    assert launch[0].strip() == "autopipe run job --steps 8"
    assert launch[1].strip().startswith("or: torchrun --nproc-per-node 2 job/train.py")
    readme = (tmp_path / "job" / "README.md").read_text()
    assert readme.index("autopipe run job --steps 8") < readme.index("torchrun --nproc-per-node 2 job/train.py")
