"""The exported torchtitan module lists, applied the way torchtitan applies them, train the model itself.

A tiny Llama (HuggingFace, from a config) is planned for torchtitan and exported; each part is a deep
copy of the whole model keeping only its listed modules (tests/_titan_split.py). Run in order they
give the whole model's logits; run by torch.distributed.pipelining's schedule on two gloo processes
(1F1B, Interleaved1F1B with parts on ranks round-robin, ZBVZeroBubble in a V) they give the whole
model's per-micro-batch losses and gradients (1e-5), every parameter trained by exactly one part.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from _launch import Launcher
from _titan_split import causal_lm_loss, llama_part, tiny_llama

import autopipe
from autopipe import Profile, partition
from autopipe.costs.layer_costs import LayerCost
from autopipe.job.export import export_plan

LAYERS = 6
HERE = Path(__file__).resolve().parent


def _ids(rows: int) -> torch.Tensor:
    return torch.randint(0, 96, (rows, 8), generator=torch.Generator().manual_seed(1))


def exported_parts(stages: int, schedule: str) -> tuple[list[list[str]], tuple[int, ...]]:
    """Plan the tiny Llama for torchtitan (layer costs chosen so the best cut is uneven) and export it."""
    model = tiny_llama(LAYERS)
    seq = autopipe.flatten(model, (_ids(2),), {})
    names = [info.name for info in seq.infos]
    heavy = {len(names) - 1: 6.0, 1: 3.0}  # a costly head and first block: not the even split
    prof = Profile(layers=tuple(LayerCost(i, n, heavy.get(i, 1.0) / 3, 2 * heavy.get(i, 1.0) / 3, params=10)
                                for i, n in enumerate(names)), signature=seq.signature, model="tiny-llama")  # fmt: skip
    plan = partition(prof, stages, schedule=schedule, microbatches=4, target="torchtitan", bandwidth=None)
    cfg = tomllib.loads(export_plan(plan, prof, "torchtitan", model=model).text)
    return cfg["parallelism"]["module_fqns_per_model_part"], plan.boundaries


def test_parts_run_in_order_give_the_models_logits() -> None:
    """Every parameter is in one part, and the parts one after another are the whole model."""
    parts, bounds = exported_parts(3, "1f1b")
    assert bounds != (0, 3, 5, 8) and any(len(p) != len(parts[0]) for p in parts)  # an uneven cut is tested
    model = tiny_llama(LAYERS)
    ids = _ids(2)
    chunks = [llama_part(model, p) for p in parts]
    held = [name for c in chunks for name, _ in c.named_parameters()]
    assert sorted(held) == sorted(name for name, _ in model.named_parameters())
    x = ids
    for c in chunks:
        x = c(x)
    torch.testing.assert_close(x, model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("schedule,name", [("1f1b", "1F1B"), ("interleaved1f1b", "Interleaved1F1B"),
                                           ("zbv", "ZBVZeroBubble")])
def test_pipelined_parts_give_the_models_losses_and_gradients(torchrun: Launcher, tmp_path: Path, schedule: str,
                                                              name: str) -> None:  # fmt: skip
    m = 4
    parts, _ = exported_parts(2, schedule)
    (tmp_path / "parts.json").write_text(json.dumps(parts))
    torchrun(HERE / "_titan_run.py", tmp_path / "parts.json", name, m, LAYERS, tmp_path, nproc=2, cwd=tmp_path,
             pythonpath=[HERE], timeout=240)  # fmt: skip
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = tiny_llama(LAYERS)
    ids = _ids(2 * m)
    per_mb = [causal_lm_loss(model(x).logits, x) for x in ids.chunk(m)]
    (sum(per_mb) / m).backward()  # torch's schedules scale the gradients by 1 / micro-batches
    losses = [x for r in ranks for x in r["losses"]]
    assert losses == pytest.approx([float(x) for x in per_mb], abs=1e-5)
    held = [n for r in ranks for n in r["held"]]
    assert sorted(held) == sorted(n for n, _ in model.named_parameters())  # each parameter on one rank
    for r in ranks:
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, model.get_parameter(n).grad, atol=1e-5, rtol=0, msg=n)
    assert sum(len(r["grads"]) for r in ranks) == len(held)
