"""Baseline partitioners: their known answers on small cases, and never an empty stage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopipe.errors import PartitionError
from autopipe.planner.baselines import (
    baseline,
    by_type,
    greedy,
    parameters,
    torchtitan,
    uniform,
)


def test_uniform_gives_the_remainder_to_the_first_stages() -> None:
    """10 layers into 4: sizes 3, 3, 2, 2 (DeepSpeed's 'uniform')."""
    assert uniform(10, 4) == (0, 3, 6, 8, 10)
    assert uniform(4, 4) == (0, 1, 2, 3, 4)


def test_parameters_balances_parameter_counts() -> None:
    """Parameter counts [8, 1, 1, 1, 1, 8] into 2: the split in the middle (10 each)."""
    assert parameters([8, 1, 1, 1, 1, 8], 2) == (0, 3, 6)
    assert parameters([38, 7, 7, 7, 7, 38], 3) == (0, 1, 5, 6)


def test_type_regex_balances_matching_layers() -> None:
    """type:block counts only layers named like 'block': 4 blocks into 2 stages, 2 each."""
    names = ["embed", "block0", "block1", "block2", "block3", "head"]
    b = by_type(names, "block", 2)
    assert b[1] in (3, 4)  # the cut falls between block1 and block2 (the free 'embed'/'head' may go either way)
    assert sum(1 for n in names[: b[1]] if "block" in n) == 2


def test_type_regex_errors() -> None:
    """A pattern matching nothing, or an invalid one, raises PartitionError."""
    with pytest.raises(PartitionError, match="matches no layer"):
        by_type(["a", "b"], "zzz", 2)
    with pytest.raises(PartitionError, match="not a valid regular expression"):
        by_type(["a", "b"], "(", 2)


def test_torchtitan_weights_first_and_last_layers() -> None:
    """Embedding + 24 blocks + head with weights 1: 26 units as 7, 7, 6, 6; with weight 4 the ends get fewer blocks."""
    assert torchtitan(26, 4) == (0, 7, 14, 20, 26)
    b = torchtitan(26, 4, input_weight=4, output_weight=4)
    assert b == (0, 5, 13, 21, 26)  # 32 units, 8 each: embed(4)+4 blocks, 8, 8, 4 blocks+head(4)


def test_greedy_cuts_nearest_the_running_time() -> None:
    """Times [1, 1, 1, 1, 2, 2] into 2: half of 8 is reached exactly after layer 3."""
    assert greedy([1, 1, 1, 1, 2, 2], 2) == (0, 4, 6)
    assert greedy([5, 1, 1, 1], 2) == (0, 1, 4)


def test_unknown_method() -> None:
    """An unknown method name lists the known ones."""
    with pytest.raises(PartitionError, match="torchtitan"):
        baseline("bogus", 2, times=[1, 1], params=[1, 1], names=["a", "b"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=40), st.integers(1, 40), st.data())
def test_baselines_never_leave_a_stage_empty(weights, chunks, data) -> None:
    """Every baseline returns chunks + 1 strictly increasing boundaries from 0 to L, even with zero weights."""
    n = len(weights)
    chunks = min(chunks, n)
    names = [data.draw(st.sampled_from(["blk", "other"])) for _ in range(n)]
    if "blk" not in names:
        names[0] = "blk"
    for method in ("uniform", "parameters", "torchtitan", "greedy", "type:blk"):
        b = baseline(method, chunks, times=[float(w) for w in weights], params=weights, names=names)
        assert len(b) == chunks + 1 and b[0] == 0 and b[-1] == n
        assert all(x < y for x, y in zip(b, b[1:])), (method, b)
