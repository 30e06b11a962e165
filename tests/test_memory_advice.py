"""CPU memory advice counts what a CPU rank really holds beyond its tensors, or says it cannot
(issue 41: `--memory-limit 100KiB` suggested "1.11 MiB and the 0 B the runtime holds beside them",
and the run then logged 7 MiB)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from _factories import net_factory_source

from autopipe.costs.layer_costs import DeviceInfo, Profile
from autopipe.errors import InfeasibleMemoryError
from autopipe.planner import partition
from autopipe.units import parse_size

MIB = 2**20


def _cpu_profile(*, reserve: int, excess: int, mode: str = "measured") -> Profile:
    """Eight layers of 1-4 MB of parameters, measured on a CPU whose probe read ``reserve`` (the ranks'
    mean beyond their tensors) and ``excess`` (the most one rank held beyond them)."""
    params = [3_000_000, 1_000_000, 2_000_000, 4_000_000, 1_000_000, 3_000_000, 2_000_000, 1_000_000]
    prof = Profile.from_costs([1.0] * 8, param_bytes=params, activation_bytes=[500_000] * 8, output_bytes=[10_000] * 8)
    return replace(prof, mode=mode, device=DeviceInfo(name="cpu", type="cpu", cores=2, threads=1),
                   reserve_bytes=reserve, rank_excess_bytes=excess)


def _suggested(message: str) -> str:
    found = re.search(r"--memory-limit (\S+) fits 2 stages", message)
    assert found, message
    return found[1]


def test_the_cpu_advice_leaves_a_rank_what_one_was_measured_holding() -> None:
    """A CPU rank was measured holding 5 MiB beyond its tensors where the reserve (a mean) is 0.1 MiB:
    the limit the refusal names leaves each rank those 5 MiB beside its tensors, and says why."""
    prof = _cpu_profile(reserve=100_000, excess=5 * MIB)
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, memory_limit=20 * MIB, bandwidth=None)
    message = str(info.value)
    limit = parse_size(_suggested(message))
    assert "5.00 MiB a CPU rank was measured holding beyond its tensors" in message, message
    assert "--exact-memory" in message  # and what the figure does not count: the heap's free blocks
    plan = partition(prof, 2, memory_limit=limit, bandwidth=None)  # the suggestion, as typed, fits
    tensors = max(plan.rank_memory) - prof.reserve_bytes
    assert tensors + 5 * MIB <= limit


def test_without_the_measured_excess_the_cpu_advice_says_what_it_cannot_promise() -> None:
    """No excess figure (a reserve given, an older profile): the tensors and the reserve, and plainly
    that a CPU rank's resident memory is not predicted beyond them."""
    prof = _cpu_profile(reserve=100_000, excess=0)
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, memory_limit=20 * MIB, bandwidth=None)
    message = str(info.value)
    assert "not predicted beyond the tensors and reserve" in message and "was not measured" in message, message
    limit = parse_size(_suggested(message))
    assert partition(prof, 2, memory_limit=limit, bandwidth=None).stages == 2


def test_plain_numbers_keep_the_reserve_alone() -> None:
    """A profile of given numbers is no CPU job's: its advice counts the reserve it carries, as before."""
    prof = _cpu_profile(reserve=100_000, excess=5 * MIB, mode="given")
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, memory_limit=20 * MIB, bandwidth=None)
    assert "97.66 KiB the runtime holds beside them" in str(info.value)
    assert "CPU rank" not in str(info.value)


def test_a_limit_under_what_a_cpu_rank_holds_names_a_limit_that_fits() -> None:
    """A limit under the measured excess leaves nothing for the model: the refusal names that excess
    (not only the smaller reserve) and a limit under which the stages fit, tried here."""
    prof = _cpu_profile(reserve=100_000, excess=5 * MIB)
    with pytest.raises(InfeasibleMemoryError) as info:
        partition(prof, 2, memory_limit=50_000, bandwidth=None)
    message = str(info.value)
    assert "leaves nothing for the model" in message and "holds 5.00 MiB per rank" in message, message
    plan = partition(prof, 2, memory_limit=_suggested(message), bandwidth=None)
    assert max(plan.rank_memory) - prof.reserve_bytes + 5 * MIB <= parse_size(_suggested(message))


@pytest.mark.slow  # measures the runtime reserve (a probe under torchrun) unless cached, and trains 3 steps on 2 ranks
def test_the_limit_cpu_advice_names_is_one_the_run_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, torchrun) -> None:
    """The issue's case on a 6-layer MLP: under --memory-limit 100KiB on this CPU convert refuses and names a
    limit; under that limit it writes the job; the job's ranks, measured as the advice counts them
    (train.py --exact-memory), peak within it every step."""
    from autopipe.job.converter import convert

    (tmp_path / "tiny.py").write_text(net_factory_source(batch_size=4))
    monkeypatch.chdir(tmp_path)
    options = dict(stages=2, schedule="1f1b", repeats=1, progress=False)
    with pytest.raises(InfeasibleMemoryError) as info:
        convert("tiny.py:build", out=tmp_path / "small", memory_limit="100KiB", **options)
    limit = _suggested(str(info.value))
    assert "a CPU rank was measured holding" in str(info.value), str(info.value)
    result = convert("tiny.py:build", out=tmp_path / "job", memory_limit=limit, **options)
    assert result.profile.rank_excess_bytes > 0
    job = result.job.job_dir
    torchrun(job / "train.py", "--steps", 3, "--exact-memory", "--log-json", tmp_path / "log.json", nproc=2, cwd=job,
             fresh=True)  # a forked rank starts on the fork server's heap, not the one a run measures from
    records = [json.loads(line) for line in (tmp_path / "log.json").read_text().splitlines()]
    assert all(r["memory_exact"] for r in records)
    peaks = [m for r in records[1:] for m in r["peak_memory"]]  # the first step has no optimizer step yet
    assert peaks and max(peaks) <= parse_size(limit), (peaks, limit)
