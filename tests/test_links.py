"""Collectives priced at the profile's own host: a CPU profile's measured gloo figures (DeviceInfo.links,
autopipe/runtime/checks/links.py) in costs/ep.py's all-to-alls and count exchange and costs/tp.py's
all-reduces; a GPU profile keeps the stated NVLink figures."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from autopipe.cluster.evaluate import node_ep_view, node_tp_view
from autopipe.costs.ep import EP_LATENCY, all_to_all, at_ep, ep_terms
from autopipe.costs.layer_costs import DeviceInfo, LayerCost, MoeShape, Profile, RecomputeCost, TpShape
from autopipe.costs.tp import TP_LATENCY, at_tp, ring_all_gather, ring_all_reduce, tp_terms
from autopipe.planner.partitioner import partition
from autopipe.runtime.checks.links import fit_link, host_links

A2A, KAPPA, AR, AG, RS = 3e-4, 5e-4, 6e-4, 2.5e-4, 7e-4  # seconds: gloo-like, 15-70x NVLink's
BW_A2A, BW_AR = 1.2e9, 1.5e9
LINKS = {"all_to_all": (A2A, BW_A2A), "count_exchange": (KAPPA, 0.0), "all_reduce": (AR, BW_AR),
         "all_gather": (AG, 0.7e9), "reduce_scatter": (RS, 0.3e9)}  # fmt: skip
CPU = DeviceInfo(name="a CPU", type="cpu", links=LINKS)
GPU = DeviceInfo(name="NVIDIA H100 80GB HBM3", type="cuda", links=LINKS)  # links on a GPU profile are ignored

MOE = MoeShape(experts=4, top_k=2, hidden=8, tokens=16, dispatch_bytes=4096, expert_param_share=0.5,
               expert_forward_share=0.6, expert_activation_bytes=100, loads=((20, 4, 4, 4),))  # fmt: skip
TP = TpShape(split_forward=0.8, split_backward=0.8, param_share=1.0, activation_share=0.5, allreduce_forward=(4096,),
             allreduce_backward=(4096, 4096), gather_forward=(1024,), divisor=8)  # fmt: skip


def _profile(device: DeviceInfo, moe_layers: int = 3) -> Profile:
    rec = {"full": RecomputeCost(10, 1.0)}
    layers = [LayerCost(i, forward_time=1e-3, backward_time=2e-3, param_bytes=400, activation_bytes=200,
                        output_bytes=64, moe=MOE if i < moe_layers else None, tp=TP, recompute=rec)
              for i in range(moe_layers + 1)]  # fmt: skip
    return Profile(layers=tuple(layers), device=device, mode="measured")


def test_a_cpu_profiles_ep_pays_its_measured_all_to_alls_and_one_count_exchange_per_forward() -> None:
    """Each MoE layer's forward adds 2 all-to-alls at the measured α and β plus the measured count
    exchange κ; its backward 2 all-to-alls, no count exchange; full recompute's forward pays κ again."""
    cpu = _profile(CPU)
    zero = at_ep(cpu, 2, bandwidth=BW_A2A, latency=0.0, count_latency=0.0)
    q = at_ep(cpu, 2, bandwidth=BW_A2A)  # the profile's own figures
    s = 20 / 32 + 4 / 32  # experts 0, 1 on rank 0: the busiest
    a2a = all_to_all(4096, 2, s, BW_A2A, A2A)
    assert a2a == pytest.approx(2 * s * 0.5 * 4096 / BW_A2A + A2A)
    for l0, l in zip(zero.layers[:3], q.layers[:3]):
        assert l.forward_time - l0.forward_time == pytest.approx(2 * A2A + KAPPA, rel=1e-9)
        assert l.backward_time - l0.backward_time == pytest.approx(2 * A2A, rel=1e-9)
        assert l.recompute["full"].extra_backward_time - l0.recompute["full"].extra_backward_time == pytest.approx(2 * A2A + KAPPA)
    assert q.layers[3] == cpu.layers[3]  # a dense layer: nothing added
    (t, *_rest) = ep_terms(cpu, 2, bandwidth=BW_A2A)
    assert (t.all_to_all, t.count_exchange) == (pytest.approx(a2a), KAPPA)
    # the same profile on a GPU: the stated NVLink latency for both, whatever links it carries
    g = at_ep(_profile(GPU), 2, bandwidth=BW_A2A)
    assert g.layers[0].forward_time - zero.layers[0].forward_time == pytest.approx(3 * EP_LATENCY, rel=1e-9)


@pytest.mark.parametrize("microbatches", [1, 4])
def test_the_count_exchange_is_charged_once_per_moe_layer_per_microbatch(microbatches: int) -> None:
    """A 1-stage plan's step grows by M · (MoE layers) · κ when κ is charged: once per layer per forward."""
    cpu = _profile(CPU)
    steps = [partition(at_ep(cpu, 2, bandwidth=BW_A2A, count_latency=k), 1, microbatches=microbatches,
                       schedule="1f1b").step_time for k in (0.0, KAPPA)]  # fmt: skip
    assert steps[1] - steps[0] == pytest.approx(microbatches * 3 * KAPPA, rel=1e-6)


def test_a_cpu_profiles_tp_pays_its_measured_latency_per_collective() -> None:
    """Per decoder layer at tp 2 (TP: one rowwise output, two colwise inputs, one gathered output): one
    forward all-reduce at the measured all-reduce α, one all-gather at the all-gather's, two backward
    all-reduces. Under sequence parallelism each all-reduce is a reduce-scatter + all-gather, their
    two αs, in the pass each runs in: a middle layer's rowwise output reduce-scatters forward and
    all-gathers its gradient backward, its colwise inputs all-gather forward and reduce-scatter
    backward; the first layer takes the data whole (its colwise inputs all-reduce backward); the
    last gathers its input whole on entry and all-reduces its output and its inputs' gradients.
    node_tp_view takes the measured all-reduce bandwidth. (Dense layers: a MoE layer runs whole on
    every tp rank and pays none.)"""
    cpu = _profile(CPU, moe_layers=0)
    three = replace(cpu, layers=tuple(replace(cpu.layers[0], index=i) for i in range(3)))
    bw = 1e12  # the bytes' share out of the way: the latencies alone
    zero, q = at_tp(cpu, 2, bandwidth=bw, latency=0.0).layers[0], at_tp(cpu, 2, bandwidth=bw).layers[0]
    assert q.forward_time - zero.forward_time == pytest.approx(AR + AG, rel=1e-6)
    assert q.backward_time - zero.backward_time == pytest.approx(2 * AR, rel=1e-6)
    sp0 = at_tp(three, 2, bandwidth=bw, latency=0.0, sequence_parallel=True).layers
    sp = at_tp(three, 2, bandwidth=bw, sequence_parallel=True).layers
    added = [(a.forward_time - b.forward_time, a.backward_time - b.backward_time) for a, b in zip(sp, sp0)]
    assert added[0] == (pytest.approx(RS + AG, rel=1e-6), pytest.approx(AG + 2 * AR, rel=1e-6))  # first
    assert added[1] == (pytest.approx(RS + 3 * AG, rel=1e-6), pytest.approx(AG + 2 * RS, rel=1e-6))  # middle
    assert added[2] == (pytest.approx(AR + 2 * AG, rel=1e-6), pytest.approx(2 * AR, rel=1e-6))  # last
    counts = [(t.forward_collectives, t.backward_collectives) for t in tp_terms(three, 2, bandwidth=bw, sequence_parallel=True)]
    assert counts == [(2, 3), (4, 3), (3, 2)], counts
    d = tp_terms(cpu, 2, bandwidth=BW_AR)[0]
    assert d.forward_collective == pytest.approx(ring_all_reduce(4096, 2, BW_AR, AR) + ring_all_gather(1024, 2, BW_AR, AG))
    node = node_tp_view(cpu, 2, gpus=2).layers[0]  # the measured all-reduce bandwidth, not topology's 5 GB/s
    assert node == at_tp(cpu, 2, bandwidth=BW_AR).layers[0] != at_tp(cpu, 2, bandwidth=5e9).layers[0]
    gpu = at_tp(_profile(GPU, moe_layers=0), 2, bandwidth=bw).layers[0]
    assert gpu.forward_time - zero.forward_time == pytest.approx(2 * TP_LATENCY, rel=1e-6)


def test_node_ep_view_takes_the_measured_all_to_all_bandwidth_unless_given() -> None:
    cpu = _profile(CPU)
    assert node_ep_view(cpu, 2, gpus=2, dp=2).layers[0] == at_ep(cpu, 2, bandwidth=BW_A2A).layers[0]
    assert node_ep_view(cpu, 2, gpus=2, dp=2, bandwidth_intra=9e9).layers[0] == at_ep(cpu, 2, bandwidth=9e9).layers[0]
    old = replace(cpu, device=replace(CPU, links={}))  # a profile made before links were recorded: the stated figures
    assert node_ep_view(old, 2, gpus=2, dp=2).layers[0] == at_ep(old, 2, bandwidth=5e9, latency=EP_LATENCY).layers[0]


def test_links_save_and_load_and_old_profiles_load(tmp_path: Path) -> None:
    cpu = _profile(CPU)
    cpu.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back.device.links == LINKS and at_ep(back, 2, bandwidth=1e9).layers[0] == at_ep(cpu, 2, bandwidth=1e9).layers[0]
    d = json.loads((tmp_path / "p.json").read_text())
    del d["device"]["links"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    assert Profile.load(tmp_path / "old.json").device.links == {}


def test_fit_recovers_latency_and_bandwidth() -> None:
    sizes = [1 << e for e in range(10, 25, 2)]
    for kind, c in (("all_reduce", 1.0), ("all_to_all", 0.5)):
        a, b = fit_link({n: 4e-4 + c * n / 1.3e9 for n in sizes}, kind, 2)
        assert (a, b) == (pytest.approx(4e-4), pytest.approx(1.3e9))
    a, b = fit_link({n: 3e-4 for n in sizes}, "all_gather", 2)  # flat: all latency
    assert a == pytest.approx(3e-4) and b > 1e15


@pytest.mark.slow
@pytest.mark.distributed  # the probe: 2 gloo processes under torchrun (~7 s)
def test_the_host_links_are_measured_once_then_cached_and_a_cpu_profile_prices_them(monkeypatch) -> None:
    """The figures a CPU profile carries are gloo's on this host, measured by the probe (an all-reduce
    costs hundreds of µs on a CPU: far above the NVLink 10 µs the constant states), cached under
    $AUTOPIPE_CACHE and read from there the next time; a profile convert makes carries them."""
    from autopipe.job.converter import with_host_links
    from autopipe.runtime.checks import links as mod

    probes = []
    real = mod.measure_links
    monkeypatch.setattr(mod, "measure_links", lambda *a, **k: probes.append(real(*a, **k)) or probes[-1])
    first = host_links(refresh=True)
    (probe,) = probes
    assert set(first) == {"all_to_all", "all_reduce", "all_gather", "reduce_scatter", "count_exchange"}
    for kind in ("all_to_all", "all_reduce", "all_gather", "reduce_scatter"):
        alpha, beta = first[kind]
        assert 5 * TP_LATENCY < alpha < 0.05 and 1e7 < beta, (kind, first[kind])
        assert len(probe["times"][kind]) == 4 and all(len(ts) == 15 for ts in probe["times"][kind].values())
    assert 5 * EP_LATENCY < first["count_exchange"][0] < 0.05
    cache = json.loads((Path(os.environ["AUTOPIPE_CACHE"]) / "links.json").read_text())
    assert [list(v) for v in first.values()] in [[list(v) for v in e.values()] for e in cache.values()]
    monkeypatch.setattr(mod, "measure_links", lambda *a, **k: pytest.fail("measured again despite the cache"))
    assert host_links() == first
    device = with_host_links(DeviceInfo(type="cpu"))
    assert device.links == first and with_host_links(GPU) is GPU
    cpu = replace(_profile(CPU, moe_layers=0), device=device)
    bw = 1e12
    q, zero = at_tp(cpu, 2, bandwidth=bw).layers[0], at_tp(cpu, 2, bandwidth=bw, latency=0.0).layers[0]
    assert q.backward_time - zero.backward_time == pytest.approx(2 * first["all_reduce"][0], rel=1e-6)
    assert q.backward_time - zero.backward_time > 10 * 2 * TP_LATENCY  # the constant would fail here


def test_a_probe_that_cannot_run_leaves_the_stated_figures_with_a_warning(monkeypatch) -> None:
    import autopipe.runtime.checks.links as probe
    from autopipe.errors import AutopipeError
    from autopipe.job.converter import with_host_links

    def fails() -> dict:
        raise AutopipeError("torchrun: the workers failed")

    monkeypatch.setattr(probe, "host_links", fails)
    device = DeviceInfo(name="cpu", type="cpu")
    with pytest.warns(UserWarning, match="could not measure this host's gloo collectives"):
        assert with_host_links(device) is device
    gpu = DeviceInfo(name="h100", type="cuda")
    assert with_host_links(gpu) is gpu  # a GPU's links are stated, never probed
