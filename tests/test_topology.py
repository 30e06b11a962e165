"""Placement and collective costs of the cluster search (autopipe/cluster/topology.py), from first principles."""

from __future__ import annotations

import pytest

from autopipe.cluster.topology import (
    Cluster,
    all_gather_time,
    all_reduce_time,
    cluster_for,
    dp_reduce_time,
    place,
    placements,
    reduce_scatter_time,
)
from autopipe.errors import PartitionError

C = Cluster(gpus=16, gpus_per_node=8, intra=100.0, inter=10.0)


def test_ring_collectives_move_the_textbook_volumes() -> None:
    """A ring all-reduce over R members sends 2(R-1)/R of the bytes per link; reduce-scatter and
    all-gather (R-1)/R each, so the two together cost one all-reduce; one member moves nothing."""
    assert all_reduce_time(400.0, 4, 100.0) == pytest.approx(2 * 3 / 4 * 4.0)
    assert reduce_scatter_time(400.0, 4, 100.0) == pytest.approx(3.0)
    assert all_gather_time(400.0, 4, 100.0) == pytest.approx(3.0)
    assert reduce_scatter_time(400.0, 4, 100.0) + all_gather_time(400.0, 4, 100.0) == pytest.approx(
        all_reduce_time(400.0, 4, 100.0))
    assert all_reduce_time(400.0, 1, 100.0) == 0.0


def test_zero_stages_traffic() -> None:
    """ZeRO 0 and 1 all-reduce the gradients; 2 reduce-scatters them and gathers the weights once;
    3 gathers the weights twice (forward, and again for the backward)."""
    g, w, r, bw = 800.0, 200.0, 8, 10.0
    assert dp_reduce_time(g, w, r, bw, 0) == dp_reduce_time(g, w, r, bw, 1) == pytest.approx(2 * 7 / 8 * 80)
    assert dp_reduce_time(g, w, r, bw, 2) == pytest.approx(7 / 8 * 80 + 7 / 8 * 20)
    assert dp_reduce_time(g, w, r, bw, 3) == pytest.approx(7 / 8 * 80 + 2 * 7 / 8 * 20)


def test_placement_decides_which_link_each_group_uses() -> None:
    """Two nodes of 8: a pipeline of 8 inside a node (pipeline-inner) reduces across nodes; its
    replicas side by side (replica-inner, 2 to a node) reduce inside one but send across nodes."""
    a = place(C, stages=8, dp=2, order="pipeline-inner")
    assert (a.p2p_link, a.dp_link, a.p2p_bandwidth, a.dp_bandwidth) == ("intra", "inter", 100.0, 10.0)
    b = place(C, stages=8, dp=2, order="replica-inner")
    assert (b.p2p_link, b.dp_link) == ("inter", "intra")
    c = place(C, stages=16, dp=1, order="pipeline-inner")  # 16 stages cannot stay in a node of 8
    assert (c.p2p_link, c.dp_link, c.dp_bandwidth) == ("inter", "none", float("inf"))
    d = place(C, stages=1, dp=16, order="replica-inner")
    assert (d.p2p_link, d.dp_link) == ("none", "inter")
    # 3 stages do not tile a node of 8: some pipeline straddles two nodes
    e = place(Cluster(24, 8, 100.0, 10.0), stages=3, dp=8, order="pipeline-inner")
    assert e.p2p_link == "inter"


def test_one_node_is_all_intra_and_placements_deduplicate() -> None:
    """Inside one node both orders use the same links, so the search tries one placement."""
    one = Cluster(gpus=4, gpus_per_node=4, intra=5.0, inter=1.0)
    ps = placements(one, stages=2, dp=2)
    assert len(ps) == 1 and (ps[0].p2p_link, ps[0].dp_link) == ("intra", "intra")
    assert len(placements(C, stages=8, dp=2)) == 2


def test_cluster_defaults_and_errors() -> None:
    """Known GPUs get their NVLink/InfiniBand figures; a partial node or an unknown device says what to give."""
    h = cluster_for("NVIDIA H100 80GB HBM3", 64)
    assert (h.gpus_per_node, h.intra, h.inter, h.nodes) == (8, 450e9, 50e9, 8)
    cpu = cluster_for("cpu", 4)
    assert (cpu.intra, cpu.gpus_per_node) == (5e9, 4)  # processes of one host by default
    with pytest.raises(PartitionError, match="whole number of nodes"):
        cluster_for("h100", 12)
    with pytest.raises(PartitionError, match="--bandwidth-intra"):
        cluster_for("tpu-v9", 8)
    with pytest.raises(PartitionError, match="not the cluster's"):
        place(C, stages=4, dp=2, order="pipeline-inner")
