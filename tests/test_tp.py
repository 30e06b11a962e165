"""Tensor parallelism priced per layer (autopipe/costs/tp_shape.py, autopipe/costs/tp.py) and searched
(autopipe/cluster/layout_search.py with tps): the shape found on a traced Llama, the formulas at a
degree, tp 1 equal to today, the search exact against solving every layout, and the CLI's --tp."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

import autopipe
from autopipe import Profile
from autopipe.cli import app
from autopipe.cluster.evaluate import SearchBounds, evaluate, tp_view
from autopipe.cluster.layout_search import search
from autopipe.cluster.layouts import Layout, enumerate_layouts
from autopipe.cluster.topology import Cluster
from autopipe.costs.layer_costs import TpShape
from autopipe.costs.tp import at_tp, ring_all_reduce, tp_terms
from autopipe.errors import InfeasibleMemoryError, PartitionError

runner = CliRunner()
B, S, H, FF, V = 2, 32, 128, 344, 512  # micro-batch, sequence, hidden, MLP, vocabulary


@pytest.fixture(scope="module")
def llama() -> Profile:
    """A Llama-shaped decoder (GQA: 8 heads, 4 key/value heads) estimated for an H100 in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=H, intermediate_size=FF, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=V, use_cache=False)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(B, S, dtype=torch.long, device="meta")
    seq = autopipe.flatten(model, (ids,))
    return autopipe.profile(seq, (ids,), estimate=True, device="h100", autocast="bfloat16", reserve=0)


def _decoder(prof: Profile) -> int:
    return next(i for i, l in enumerate(prof.layers) if l.name.endswith("layers.0"))


def test_llama_shape_follows_megatrons_pairs(llama: Profile) -> None:
    """A decoder layer: two all-reduces of b·s·h·2 bytes forward (after o_proj and down_proj), two
    backward (q/k/v's shared input, gate/up's); every weight but the two norms' sharded; the key/value
    heads (4) the divisor. The embedding is vocab-sharded (one all-reduce), the head gathers its logits."""
    act = B * S * H * 2
    dec = llama.layers[_decoder(llama)].tp
    assert dec is not None
    assert dec.allreduce_forward == (act, act) and dec.allreduce_backward == (act, act) and dec.gather_forward == ()
    norms = 2 * H  # two RMSNorm weights' elements
    assert dec.param_share == pytest.approx(1 - norms / llama.layers[_decoder(llama)].params)
    assert dec.divisor == 4
    assert 0.3 < dec.split_forward < 1 and 0.3 < dec.split_backward < 1  # norms, residuals, rotary tables stay whole
    assert 0 < dec.activation_share < 1
    emb, head = llama.layers[0].tp, llama.layers[-1].tp
    assert emb is not None and emb.allreduce_forward == (act,) and emb.allreduce_backward == ()
    assert head is not None and head.gather_forward == (B * S * V * 2,) and head.allreduce_backward == (act,)
    norm = next(l for l in llama.layers if l.name == "model.norm").tp
    assert norm is not None and norm.divisor == 0 and norm.allreduce_forward == ()


def test_profile_with_tp_saves_and_old_profiles_load(llama: Profile, tmp_path) -> None:
    llama.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == llama
    old = llama.to_dict()
    for layer in old["layers"]:
        del layer["tp"]
    prof = Profile.from_dict(old)
    assert all(l.tp is None for l in prof.layers)
    with pytest.raises(PartitionError, match="records no tensor-parallel shapes"):
        at_tp(prof, 2, bandwidth=1e9)


def test_at_tp_divides_as_the_formulas_say(llama: Profile) -> None:
    """Compute f·σ/t + f·(1−σ), plus a ring all-reduce 2(t−1)/t·B/bw + α per collective; weights by
    π/t + 1 − π; activations by κ/t + 1 − κ, or all of them by t under sequence parallelism."""
    i, bw, lat = _decoder(llama), 450e9, 1e-5
    l, shape = llama.layers[i], llama.layers[i].tp
    assert shape is not None
    for t in (2, 4):
        q = at_tp(llama, t, bandwidth=bw, latency=lat).layers[i]
        ar = 2 * ring_all_reduce(B * S * H * 2, t, bw, lat)
        assert ar == pytest.approx(2 * (2 * (t - 1) / t * B * S * H * 2 / bw + lat))
        assert q.forward_time == pytest.approx(l.forward_time * (shape.split_forward / t + 1 - shape.split_forward) + ar)
        assert q.backward_time == pytest.approx(l.backward_time * (shape.split_backward / t + 1 - shape.split_backward) + ar)
        k = shape.param_share / t + 1 - shape.param_share
        assert (q.param_bytes, q.grad_bytes, q.optimizer_bytes) == tuple(
            round(x * k) for x in (l.param_bytes, l.grad_bytes, l.optimizer_bytes))
        a = shape.activation_share / t + 1 - shape.activation_share
        assert q.activation_bytes == round(l.activation_bytes * a)
        assert q.output_bytes == l.output_bytes  # whole on every tp rank between layers
        sp = at_tp(llama, t, sequence_parallel=True, bandwidth=bw, latency=lat).layers[i]
        assert sp.activation_bytes == round(l.activation_bytes / t) and sp.output_bytes == round(l.output_bytes / t)
        # reduce-scatter + all-gather: the all-reduce's bytes, two latencies each
        assert sp.forward_time == pytest.approx(l.forward_time / t + ar + 2 * lat)
    norm = next(j for j, l in enumerate(llama.layers) if l.name == "model.norm")
    assert at_tp(llama, 4, bandwidth=bw).layers[norm] == llama.layers[norm]  # nothing to shard: replicated


def test_tp_terms_count_the_collective_bytes(llama: Profile) -> None:
    """What a measured tp run is held to: per layer, compute and collective seconds and the bytes."""
    terms = tp_terms(llama, 2, bandwidth=450e9)
    act = B * S * H * 2
    d = terms[_decoder(llama)]
    assert (d.forward_bytes, d.backward_bytes, d.forward_collectives, d.backward_collectives) == (2 * act, 2 * act, 2, 2)
    prof2 = at_tp(llama, 2, bandwidth=450e9)
    for term, layer in zip(terms, prof2.layers):
        assert term.forward_compute + term.forward_collective == pytest.approx(layer.forward_time + layer.forward_gap)
        assert term.backward_compute + term.backward_collective == pytest.approx(layer.backward_time + layer.backward_gap)
    assert terms[-1].forward_bytes == B * S * V * 2  # the head's gathered logits


def test_tp_one_is_todays_numbers_exactly(llama: Profile) -> None:
    assert at_tp(llama, 1, bandwidth=1.0) is llama
    cluster = Cluster(gpus=8, gpus_per_node=8, intra=450e9, inter=50e9)
    a = search(llama, cluster, global_batch=8, memory_limit=None)
    b = search(llama, cluster, global_batch=8, memory_limit=None, tps=(1,))
    assert [x.key() for x in a.layouts] == [x.key() for x in b.layouts]
    assert [x.step_time for x in a.layouts] == [x.step_time for x in b.layouts]
    assert all(x.tp == 1 for x in a.layouts) and a.plan is not None and a.plan.tp == 1


def test_bad_degrees_are_refused(llama: Profile) -> None:
    with pytest.raises(PartitionError, match="does not divide layer"):
        at_tp(llama, 8, bandwidth=1e9)  # 4 key/value heads
    with pytest.raises(PartitionError, match="does not divide the node"):
        search(llama, Cluster(gpus=8, gpus_per_node=8, intra=1e9, inter=1e9), global_batch=8, memory_limit=None, tps=(3,))


# ---- the search against brute force, on plain numbers --------------------------------------------

CLUSTER = Cluster(gpus=8, gpus_per_node=4, intra=4000.0, inter=400.0)


def _tp_profile(seed: int) -> Profile:
    rng = random.Random(seed)
    n = 6
    prof = Profile.from_costs(
        [rng.uniform(0.5, 3.0) for _ in range(n)],
        param_bytes=[rng.randrange(50, 400) for _ in range(n)],
        activation_bytes=[rng.randrange(20, 120) for _ in range(n)],
        output_bytes=[rng.randrange(10, 60) for _ in range(n - 1)] + [0],
    )
    layers = []
    for l in prof.layers:
        shape = TpShape(split_forward=rng.uniform(0.5, 0.95), split_backward=rng.uniform(0.5, 0.95),
                        param_share=rng.uniform(0.6, 1.0), activation_share=rng.uniform(0.3, 0.9),
                        allreduce_forward=(rng.randrange(50, 400),) * 2, allreduce_backward=(rng.randrange(50, 400),) * 2,
                        divisor=4)  # fmt: skip
        layers.append(replace(l, tp=shape))
    return prof.with_layers(layers)


def _solve_all(prof: Profile, limit: int | None, tps=(1, 2, 4)) -> list[Layout]:
    out = []
    for t in tps:
        for x in enumerate_layouts(len(prof.layers), CLUSTER, 8, tp=t):
            try:
                done, _ = evaluate(prof, CLUSTER, x, memory_limit=limit)
            except InfeasibleMemoryError:
                continue
            out.append(done)
    return sorted(out, key=lambda x: -(x.throughput or 0.0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_with_tp_finds_brute_forces_best(seed: int) -> None:
    """Every degree's layouts solved one by one, against the pruned search over tp 1, 2, 4: the same
    best throughputs, the plan recording the winner's tp; and some tp > 1 layout is among them."""
    prof = _tp_profile(seed)
    free = [x.peak_memory or 0 for x in _solve_all(prof, None)]
    limit = int(min(free) + 0.3 * (max(free) - min(free)))
    brute = [x for x in _solve_all(prof, limit) if x.dp == 1 or x.zero != 3]
    res = search(prof, CLUSTER, global_batch=8, memory_limit=limit, top=3, tps=(1, 2, 4))
    assert [x.throughput for x in res.layouts[:3]] == pytest.approx([x.throughput for x in brute[:3]], rel=1e-9)
    assert res.best is not None and res.plan is not None
    assert res.plan.tp == res.best.tp and res.plan.world == CLUSTER.gpus
    assert res.solved < res.considered
    assert {x.tp for x in brute} == {1, 2, 4}


def test_bounds_hold_at_every_degree() -> None:
    """The throughput bound (with its send/recv and fill terms) is never below a solved layout's
    throughput, and the memory bound refuses only layouts with no cut that fits, at every tp."""
    prof = _tp_profile(3)
    limit = 2600
    for t in (1, 2, 4):
        sample = Layout(1, 1, 1, 1, "1f1b", 1, 0, "pipeline-inner", tp=t)
        prof_t, cluster_t = tp_view(prof, CLUSTER, sample)
        bounds = SearchBounds(prof_t, None, limit, cluster_t)
        for x in enumerate_layouts(len(prof.layers), CLUSTER, 8, tp=t):
            try:
                done, _ = evaluate(prof, CLUSTER, x, memory_limit=limit)
            except InfeasibleMemoryError:
                done = None
            scale = float(x.microbatch_size)
            if not bounds.fits(x, scale):
                assert done is None, x
            if done is not None:
                assert done.throughput <= bounds.throughput(x, scale) * (1 + 1e-9), x


# ---- the CLI -----------------------------------------------------------------------------------


def _run(*args: str):
    result = runner.invoke(app, list(args), env={"COLUMNS": "250"})
    return result, result.output


def test_plan_gpus_tp_auto_shows_tp(llama: Profile, tmp_path) -> None:
    path = tmp_path / "p.json"
    llama.save(path)
    result, out = _run("plan", str(path), "--gpus", "16", "--global-batch", "16", "--tp", "auto", "--memory-limit", "none")
    assert result.exit_code == 0, out
    assert "┃ tp ┃" in out
    result, out = _run("plan", str(path), "--gpus", "16", "--global-batch", "16", "--tp", "4", "--json",
                       "--memory-limit", "none")  # fmt: skip
    assert result.exit_code == 0, out
    import json

    data = json.loads(out)
    assert data["plan"]["tp"] == 4 and all(x["tp"] == 4 for x in data["search"]["layouts"])
    result, out = _run("plan", str(path), "--stages", "2", "--tp", "2", "--json")
    assert result.exit_code == 0 and json.loads(out)["plan"]["tp"] == 2


@pytest.mark.parametrize("args, expected", [
    (("--gpus", "16", "--global-batch", "16", "--tp", "3"), "--tp 3 does not divide the node's 8 devices"),
    (("--gpus", "16", "--global-batch", "16", "--tp", "two"), "--tp 'two': give a degree like 8"),
    (("--stages", "2", "--tp", "auto"), "with --stages give one degree"),
    (("--stages", "2", "--tp", "8"), "tp 8 does not divide layer"),
])
def test_bad_tp_is_one_line(llama: Profile, tmp_path, args, expected) -> None:
    path = tmp_path / "p.json"
    llama.save(path)
    result, out = _run("plan", str(path), *args)
    lines = [line for line in out.splitlines() if line.strip()]
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error:"), out
    assert expected in lines[0]


def test_recompute_floor_holds_on_a_traced_llama(llama: Profile) -> None:
    """The bound with the recompute every cut needs (evaluate.SearchBounds.throughput_with_recompute)
    never falls below a solved layout's throughput, under a limit that forces recompute, at tp 1 and 2."""
    cluster = Cluster(gpus=4, gpus_per_node=4, intra=450e9, inter=50e9)
    plain, full = [], []
    for x in enumerate_layouts(len(llama.layers), cluster, 8):
        plain.append(evaluate(llama, cluster, x, memory_limit=None, recompute="none")[0].peak_memory or 0)
        full.append(evaluate(llama, cluster, x, memory_limit=None, recompute="full")[0].peak_memory or 0)
    limit = (min(plain) + min(full)) // 2  # below every layout's peak without recompute, above some with it
    checked = recomputed = 0
    for t in (1, 2):
        sample = Layout(1, 1, 1, 1, "1f1b", 1, 0, "pipeline-inner", tp=t)
        prof_t, cluster_t = tp_view(llama, cluster, sample)
        bounds = SearchBounds(prof_t, None, limit, cluster_t)
        for x in enumerate_layouts(len(llama.layers), cluster, 8, tp=t):
            try:
                done, _ = evaluate(llama, cluster, x, memory_limit=limit)
            except InfeasibleMemoryError:
                continue
            checked += 1
            recomputed += any(m != "none" for m in done.recompute)
            scale = x.microbatch_size / B  # the profile's own micro-batch is B samples
            assert done.throughput <= bounds.throughput_with_recompute(x, scale) * (1 + 1e-9), x
    assert checked and recomputed


def test_a_layer_timed_at_tp_is_priced_by_its_ratio_and_its_flops_by_the_shares(llama: Profile, tmp_path) -> None:
    """``TpShape.timed`` (what convert --tp records on a CPU): at the degree timed, each layer's compute
    is its seconds times the ratio, the collectives priced on top as before; its FLOPs and memory still
    divide by the shares; another degree (or sequence parallelism) is priced by the shares alone; the
    record saves and loads."""
    from autopipe.costs.tp import with_tp_timed

    ratios = [(1.3 + 0.01 * i, 0.9 - 0.01 * i) for i in range(len(llama.layers))]
    timed = with_tp_timed(llama, 2, ratios)
    timed.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == timed
    shares, at2 = at_tp(llama, 2, bandwidth=450e9), at_tp(timed, 2, bandwidth=450e9)
    for l, s, q, term, (rf, rb) in zip(llama.layers, shares.layers, at2.layers, tp_terms(timed, 2, bandwidth=450e9), ratios):
        if l.tp is None:
            assert q == s
            continue
        assert q.forward_time == pytest.approx(l.forward_time * rf + term.forward_collective, rel=1e-12)
        assert q.backward_time == pytest.approx(l.backward_time * rb + term.backward_collective, rel=1e-12)
        assert term.forward_compute == pytest.approx((l.forward_time + l.forward_gap) * rf, rel=1e-12)
        assert (q.flops, q.param_bytes, q.activation_bytes) == (s.flops, s.param_bytes, s.activation_bytes)
    def times(p: Profile) -> list[tuple[float, float]]:
        return [(l.forward_time, l.backward_time) for l in p.layers]

    assert times(at_tp(timed, 4, bandwidth=450e9)) == times(at_tp(llama, 4, bandwidth=450e9))
    assert times(at_tp(timed, 2, bandwidth=450e9, sequence_parallel=True)) == \
        times(at_tp(llama, 2, bandwidth=450e9, sequence_parallel=True))
    assert times(at2) != times(shares)
    again = with_tp_timed(timed, 2, [(1.0, 1.0)] * len(llama.layers))  # a second timing replaces the first
    assert all(l.tp is None or l.tp.timed == ((2, False, 1.0, 1.0),) for l in again.layers)
    with pytest.raises(PartitionError, match="timed ratios for a profile of"):
        with_tp_timed(llama, 2, ratios[:-1])


def test_convert_gpus_searches_a_degree_left_out_and_keeps_one_given_even_1(llama: Profile) -> None:
    """convert --gpus: tp (and ep) left out are searched; --tp 1 fixes tp 1 (no tp on this cluster), as
    --tp 4 fixes 4; a copy of the settings (dataclasses.replace, as convert(model, settings, **options)
    makes) keeps what its original fixed."""
    from autopipe.job.converter import _searched_tps
    from autopipe.job.settings import ConvertSettings

    searched = ConvertSettings(gpus=8, global_batch=64)
    assert (searched.tp, searched.ep, searched.fixed) == (1, 1, ())
    assert _searched_tps(llama, searched) == [1, 2, 4]  # dividing 8 and the 4 key/value heads
    one = ConvertSettings(gpus=8, global_batch=64, tp=1, ep=1)
    assert one.fixed == ("tp", "ep") and _searched_tps(llama, one) == [1]
    assert _searched_tps(llama, ConvertSettings(gpus=8, global_batch=64, tp=4)) == [4]
    assert replace(one, global_batch=32).fixed == ("tp", "ep")
    assert replace(searched, tp=4).fixed == ("tp",) and replace(searched, global_batch=32).fixed == ()
    assert ConvertSettings(stages=2).tp == 1 and ConvertSettings(stages=2, tp=2).tp == 2
