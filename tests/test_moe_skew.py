"""Routing skew measured on a real HF Mixtral and priced at an expert-parallel degree.

The loads the profile records are the router's own choices: counted by a hook on the untouched
model's experts module, checked against the indices its router module returns (a hook on
``mlp.gate``, the HF module itself). at_ep at ep 1 is the profile; the experts' parameters divide by
ep as the HF module's own parameter bytes say; a skewed router moves the cut a balanced one keeps.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_skew_models as M  # noqa: E402

import autopipe  # noqa: E402
from autopipe.cli.app import app  # noqa: E402
from autopipe.costs.ep import at_ep, check_ep, ep_degrees_for, ep_terms  # noqa: E402
from autopipe.costs.layer_costs import Profile  # noqa: E402
from autopipe.costs.moe_shape import moe_shapes, with_moe_shapes  # noqa: E402
from autopipe.errors import PartitionError  # noqa: E402
from autopipe.graph.sources import load_model  # noqa: E402
from autopipe.planner.partitioner import partition  # noqa: E402

pytestmark = pytest.mark.slow  # the module's one trace and estimate of a 6-layer Mixtral: ~6 s on 2 shared cores

MORE = M.batches(5)
BW = 5e9


@pytest.fixture(scope="module")
def skewed():
    ms = load_model("tests/moe_skew_models.py:mixtral_skewed", device="cpu")
    seq = autopipe.flatten(ms.model, ms.args, ms.kwargs)
    batches = [(ms.args, ms.kwargs), *MORE]
    # an estimated profile (the roofline on this CPU's probed rate): what the cut test asks is whether the
    # skew moves a cut, and a measured one's noise on 2 shared cores (42 % under load) moved the balanced
    # cut too; bench/bench_moe_skew.py shows the same on measured profiles with their spread
    prof = autopipe.profile(seq, ms.args, ms.kwargs, device="cpu", estimate=True, progress=False, tp_shapes=False)
    return ms, seq, batches, with_moe_shapes(prof, moe_shapes(ms.model, seq, batches))


def _router_counts(model: torch.nn.Module, batches: list) -> dict[int, list[tuple[int, ...]]]:
    """Per decoder layer, per batch: bincount of the indices the untouched router module returns."""
    got: dict[int, list[tuple[int, ...]]] = {}
    current: dict[int, torch.Tensor] = {}

    def hook(i: int):
        def f(_m, _a, out):
            idx = out[2].reshape(-1)
            c = torch.bincount(idx, minlength=M.EXPERTS)
            current[i] = c if i not in current else current[i] + c
        return f

    layers = model.model.layers
    handles = [layers[i].mlp.gate.register_forward_hook(hook(i)) for i in range(len(layers))]
    with torch.no_grad():
        for args, kwargs in batches:
            current.clear()
            model(*args, **kwargs)
            for i, c in current.items():
                got.setdefault(i, []).append(tuple(c.tolist()))
    for h in handles:
        h.remove()
    return got


def test_loads_are_the_routers_own_choices(skewed):
    ms, seq, batches, prof = skewed
    reference = _router_counts(ms.model, batches)
    moe = {l.index: l.moe for l in prof.layers if l.moe is not None}
    assert sorted(moe) == [1, 2, 3, 4, 5, 6]  # the decoder layers, after the embedding
    for i, shape in moe.items():
        assert shape.loads == tuple(reference[i - 1])
        assert (shape.experts, shape.top_k, shape.hidden, shape.tokens) == (M.EXPERTS, M.TOP_K, 64, M.B * M.T)
        assert shape.dispatch_bytes == M.B * M.T * M.TOP_K * 64 * 4
    # the biased routers' hot experts take most slots; the others do not
    for i in (1, 2):
        assert sum(moe[i].shares()[e] for e in M.HOT) > 0.6
        assert moe[i].busiest(0.95) > 0.3
    for i in (3, 4, 5, 6):
        assert sum(moe[i].shares()[e] for e in M.HOT) < 0.45
    again = Profile.from_dict(json.loads(json.dumps(prof.to_dict())))
    assert again.layers[1].moe == prof.layers[1].moe


def test_ep_1_is_the_profile_and_memory_divides(skewed):
    ms, _seq, _b, prof = skewed
    assert at_ep(prof, 1, bandwidth=BW) is prof
    layer = ms.model.model.layers[0]
    whole = sum(p.numel() * p.element_size() for p in layer.parameters())
    experts = sum(p.numel() * p.element_size() for p in layer.mlp.experts.parameters())
    assert prof.layers[1].param_bytes == whole
    for ep in (2, 4, 8):
        q = at_ep(prof, ep, bandwidth=BW).layers[1]
        assert abs(q.param_bytes - (whole - experts + experts / ep)) <= 1
        assert abs(q.optimizer_bytes - 2 * (whole - experts + experts / ep)) <= 2
    dense = at_ep(prof, 4, bandwidth=BW).layers[0]
    assert dense == prof.layers[0]  # the embedding holds no experts


def test_skew_moves_the_cut_balance_does_not(skewed):
    *_, prof = skewed
    balanced = partition(at_ep(prof, 4, bandwidth=BW, skew="balanced"), 2, microbatches=4)
    p95 = partition(at_ep(prof, 4, bandwidth=BW, skew="p95"), 2, microbatches=4)
    assert p95.boundaries != balanced.boundaries
    assert p95.boundaries[1] < balanced.boundaries[1]  # the skewed layers come first: stage 0 holds fewer
    assert p95.predicted_step > balanced.predicted_step
    terms = ep_terms(prof, 4, bandwidth=BW)
    assert terms[0].skew_seconds > 0 and terms[0].share > 0.5
    assert all(t.skew_seconds == 0 for t in ep_terms(prof, 4, bandwidth=BW, skew="balanced"))


def test_refusals_and_degrees(skewed, tmp_path):
    *_, prof = skewed
    dense = Profile.from_costs([1.0, 2.0])
    with pytest.raises(PartitionError, match="no mixture-of-experts"):
        check_ep(dense, 2)
    with pytest.raises(PartitionError, match="does not divide layer 1"):
        check_ep(prof, 3)
    with pytest.raises(PartitionError, match="unknown skew"):
        check_ep(prof, 2, "p99")
    assert ep_degrees_for(dense, 8) == [1]
    assert ep_degrees_for(prof, 4) == [1, 2, 4]
    path = tmp_path / "moe.json"
    prof.save(path)
    runner = CliRunner()
    ok = runner.invoke(app, ["plan", str(path), "--stages", "2", "--dp", "4", "--ep", "4", "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.output)["plan"]
    assert data["ep"] == 4
    bad = runner.invoke(app, ["plan", str(path), "--stages", "2", "--dp", "2", "--ep", "4"], env={"COLUMNS": "250"})
    assert bad.exit_code != 0 and "does not divide the 2 data-parallel replicas" in bad.output
    assert "Traceback" not in bad.output


def test_report_draws_each_moe_layers_load_and_its_cost(skewed):
    from autopipe.report.page import render_report

    *_, prof = skewed
    plan = partition(at_ep(prof, 4, bandwidth=5e9), 2, microbatches=4)
    plan = __import__("dataclasses").replace(plan, ep=4, dp=4)
    html = render_report(plan, prof)
    assert "Mixture of experts: expert load" in html
    assert html.count("<title>expert ") == 6 * M.EXPERTS  # a bar per expert per MoE layer
    cost = sum(t.skew_seconds for t in ep_terms(prof, 4, bandwidth=5e9)) * plan.microbatches
    assert f"<b>{cost * 1e3:.3f}</b>" in html
    dense = Profile.from_costs([1.0] * len(prof.layers))
    assert "Mixture of experts" not in render_report(partition(dense, 2), dense)


def test_gpus_search_prices_ep_for_moe_profiles_only(skewed):
    from autopipe.cluster.layout_search import search
    from autopipe.cluster.topology import cluster_for

    *_, prof = skewed
    cluster = cluster_for("cpu", 8, 8)
    res = search(prof, cluster, global_batch=8, memory_limit=None, top=50, prune=False, zeros=(0,),
                 eps=ep_degrees_for(prof, 8))  # fmt: skip
    eps = {x.ep for x in res.layouts}
    assert eps == {1, 2, 4, 8}
    assert all(x.dp % x.ep == 0 for x in res.layouts)
    assert res.plan is not None and res.plan.ep == res.best.ep
    # each ep layout is the fixed-layout pricing of that ep (node_ep_view's formulas), solved
    x = next(x for x in res.layouts if x.ep == 4 and x.stages == 2)
    from autopipe.cluster.evaluate import evaluate

    again, plan = evaluate(prof, cluster, x, memory_limit=None)
    assert plan is not None and plan.ep == 4 and again.step_time == x.step_time
    dense = Profile.from_costs([1.0] * 6, param_bytes=[100] * 6, activation_bytes=[10] * 6)
    assert ep_degrees_for(dense, 8) == [1]
    plain = search(dense, cluster, global_batch=8, memory_limit=None)
    same = search(dense, cluster, global_batch=8, memory_limit=None, eps=ep_degrees_for(dense, 8))
    assert [y.key() for y in plain.layouts] == [y.key() for y in same.layouts]
