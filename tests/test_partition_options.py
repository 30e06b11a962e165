"""PartitionOptions: the one record of partition's options, the same plan as the keywords, checked when made."""

from __future__ import annotations

import inspect
from dataclasses import fields, replace

import pytest

from autopipe import Profile
from autopipe.errors import PartitionError
from autopipe.planner import PartitionOptions, partition


def _profile() -> Profile:
    """8 layers of known cost: 400 B of parameters, 50 B kept for backward, 8 B across each cut."""
    return Profile.from_costs([1.0 + (i % 3) for i in range(8)], param_bytes=[400] * 8,
                              activation_bytes=[50] * 8, output_bytes=[8] * 8)  # fmt: skip


def test_options_record_gives_the_keyword_calls_plan() -> None:
    """partition(prof, options=PartitionOptions(...)) is the keyword call's Plan, field for field."""
    prof = _profile()
    keywords = dict(schedule="zbv", microbatches=4, memory_limit=8000, recompute="auto", dp=2, zero="auto",
                    bandwidth=None, weight_share=0.4)  # fmt: skip
    by_keywords = partition(prof, 2, **keywords)  # type: ignore[arg-type]
    by_record = partition(prof, options=PartitionOptions(2, **keywords))  # type: ignore[arg-type]
    assert by_record == by_keywords and repr(by_record) == repr(by_keywords)
    assert (by_record.zero, by_record.stage_recompute) == (2, ("full", "full", "none", "none"))  # the limit binds
    baseline = partition(prof, options=replace(PartitionOptions(2, **keywords), method="uniform"))  # type: ignore[arg-type]
    assert baseline == partition(prof, 2, method="uniform", **keywords)  # type: ignore[arg-type]


def test_a_misspelled_option_is_refused_in_one_line() -> None:
    """A misspelled name fails as one PartitionError line naming the closest option, not a TypeError."""
    with pytest.raises(PartitionError) as e:
        PartitionOptions.from_options(stages=2, recompte="full")
    assert str(e.value) == "unknown partition option 'recompte'; did you mean 'recompute'?"
    with pytest.raises(PartitionError, match="^recompute='ful'; use one of none, auto, selective, full.$"):
        PartitionOptions(2, recompute="ful")  # a misspelled value fails where the record is made, before any solve


def test_options_and_keywords_together_are_refused() -> None:
    """options= beside a keyword (or stages) is refused, saying how to change one field of the record."""
    opts = PartitionOptions(2, bandwidth=None)
    with pytest.raises(PartitionError, match=r"not both \(schedule='gpipe' beside options\); use "
                                             r"options=dataclasses.replace\(options, schedule='gpipe'\)"):
        partition(_profile(), options=opts, schedule="gpipe")
    with pytest.raises(PartitionError, match=r"not both \(stages=2 beside options\)"):
        partition(_profile(), 2, options=opts)
    with pytest.raises(PartitionError, match="partition needs stages"):
        partition(_profile())


def test_partition_keywords_and_record_fields_agree() -> None:
    """partition's keywords are the record's fields, with the same defaults: one set of options, written twice only in the signature."""
    params = inspect.signature(partition).parameters
    keywords = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and n != "options"}
    assert list(keywords) == [f.name for f in fields(PartitionOptions)][1:]
    assert keywords == {f.name: f.default for f in fields(PartitionOptions) if f.name != "stages"}


def test_of_plan_replans_the_same_plan() -> None:
    """The options of a plan's job re-plan it exactly (what compare_baselines plans each baseline under)."""
    prof = _profile()
    plan = partition(prof, 2, schedule="interleaved1f1b", microbatches=4, memory_limit=6000, dp=2, zero="auto")
    opts = PartitionOptions.of_plan(plan)
    assert (opts.schedule, opts.v, opts.zero, opts.memory_limit) == ("interleaved1f1b", 2, "auto", 6000)
    assert plan.zero == 1 and partition(prof, options=opts) == plan
