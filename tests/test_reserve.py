"""The runtime reserve: measured once per device by a real 2-rank pipeline, cached, kept in profiles."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autopipe.errors import AutopipeError
from autopipe.reserve import ASSUMED_CUDA_RESERVE, reserve_for, runtime_reserve

MIB = 2**20


def test_the_cpu_reserve_is_measured_once_then_read_from_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """First call: a probe pipeline measures more than the memory model counts (allocator and runtime);
    the figure is cached under $AUTOPIPE_CACHE and the next call reads it without measuring."""
    first = runtime_reserve("cpu")
    assert 1 * MIB < first < 512 * MIB, first
    cache = Path(os.environ["AUTOPIPE_CACHE"]) / "reserve.json"
    assert first in json.loads(cache.read_text()).values()

    def no_probe(device: str):  # noqa: ANN202
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr("autopipe.reserve.measure_reserve", no_probe)
    assert runtime_reserve("cpu") == first


def test_reserve_for_a_profile() -> None:
    """Given sizes win; estimates for a named GPU use the assumed figure; cpu is this machine's."""
    assert reserve_for("cpu", estimate=False, given="64MiB") == 64 * MIB
    assert reserve_for("cpu", estimate=False, given=0) == 0
    assert reserve_for("h100", estimate=True) == ASSUMED_CUDA_RESERVE
    assert reserve_for("cpu", estimate=True) == runtime_reserve("cpu")
    with pytest.raises(AutopipeError, match="measured on cpu or cuda"):
        runtime_reserve("tpu")
