"""Where a layout's ranks sit on a cluster and what their communication costs. No torch.

A cluster is ``gpus`` devices, ``gpus_per_node`` to a node, with one bandwidth inside a node and one
between nodes (bytes/s per device, per direction). A layout is ``stages`` pipeline ranks times ``dp``
data-parallel replicas of each; a placement numbers its world ranks one of two ways:

- ``pipeline-inner``: rank = replica·S + stage, a pipeline's stages on consecutive devices (Megatron
  puts pipeline outermost; this is the other order, which keeps send/recv inside a node);
- ``replica-inner``: rank = stage·R + replica, a stage's replicas on consecutive devices (Megatron's
  order without tensor parallelism: the gradient reduction stays inside a node).

A group of ranks talks over the intra-node link when all its members share one node, else over the
inter-node link (the slowest link a ring crosses sets its pace). The pipeline takes one bandwidth for
all of its cuts (``autopipe.partition`` has one): the slowest any pair of neighbours crosses, so a
pipeline that leaves its node at one cut is costed as if every cut did (an upper bound on the step).

Collectives are rings with bandwidth terms only (no latency term; NCCL's ring and the NVLink/IB
figures below): over R members, all-reduce moves 2(R−1)/R of the bytes through each link,
reduce-scatter and all-gather (R−1)/R each. Complexity: O(1) per call.

Example:
    >>> c = Cluster(gpus=16, gpus_per_node=8, intra=400e9, inter=50e9)
    >>> place(c, stages=2, dp=8, order="replica-inner").dp_link, place(c, stages=2, dp=8, order="pipeline-inner").dp_link
    ('intra', 'inter')
    >>> all_reduce_time(1e9, 8, 400e9)  # 2·7/8 GB over 400 GB/s
    0.004375
"""

from __future__ import annotations

from dataclasses import dataclass

from ..choices import PLACEMENTS
from ..errors import PartitionError

__all__ = ["Cluster", "Placement", "tp_cluster", "LINKS", "PLACEMENTS", "cluster_for", "place", "placements",
           "all_reduce_time", "reduce_scatter_time", "all_gather_time", "dp_reduce_time"]  # fmt: skip

# (intra-node, inter-node) bytes/s per device and direction, and devices per node, of known parts.
# H100/H200 SXM: NVLink 4 at 900 GB/s bidirectional per GPU (NVIDIA H100 datasheet) = 450 GB/s each
# way; across nodes one ConnectX-7 400 Gb/s InfiniBand NIC per GPU (DGX H100) = 50 GB/s.
# A100 SXM: NVLink 3 at 600 GB/s bidirectional (A100 datasheet) = 300 GB/s; DGX A100 has one
# 200 Gb/s HDR NIC per GPU = 25 GB/s.
# CPU: nothing measured; ranks on one host pass tensors through shared memory (gloo), a stated
# 5 GB/s, and hosts through 10 Gb Ethernet, 1.25 GB/s; by default every rank is on one host (0).
LINKS: dict[str, tuple[float, float, int]] = {
    "h100": (450e9, 50e9, 8),
    "h200": (450e9, 50e9, 8),
    "a100": (300e9, 25e9, 8),
    "cpu": (5e9, 1.25e9, 0),
}


@dataclass(frozen=True)
class Cluster:
    """N devices, ``gpus_per_node`` to a node, and the bandwidths (bytes/s per device, one way)."""

    gpus: int
    gpus_per_node: int
    intra: float
    inter: float

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)


@dataclass(frozen=True)
class Placement:
    """How a layout's ranks sit: which link the pipeline's send/recv and the replicas' reduction use."""

    order: str  # pipeline-inner | replica-inner
    p2p_link: str  # intra | inter | none (one stage)
    dp_link: str  # intra | inter | none (one replica)
    p2p_bandwidth: float  # bytes/s; inf with one stage
    dp_bandwidth: float  # bytes/s; inf with one replica


def cluster_for(device: str, gpus: int, gpus_per_node: int | None = None, intra: float | None = None,
                inter: float | None = None) -> Cluster:  # fmt: skip
    """A cluster of ``gpus`` devices of a known kind (a key of LINKS, or a name containing one, like
    "NVIDIA H100 80GB HBM3"), with its default links unless given."""
    key = next((k for k in LINKS if k in device.lower()), None)
    if key is None and (intra is None or inter is None or gpus_per_node is None):
        raise PartitionError(
            f"no default bandwidths for device {device!r}; give --gpus-per-node, --bandwidth-intra and "
            f"--bandwidth-inter (known: {', '.join(LINKS)})."
        )
    d_intra, d_inter, d_per = LINKS[key] if key else (0.0, 0.0, 1)
    per = gpus_per_node if gpus_per_node is not None else (d_per or gpus)
    if gpus < 1 or per < 1:
        raise PartitionError(f"--gpus {gpus} and --gpus-per-node {per} must both be at least 1.")
    if gpus > per and gpus % per:
        raise PartitionError(f"--gpus {gpus} is not a whole number of nodes of {per}; use a multiple of {per}.")
    c = Cluster(gpus=gpus, gpus_per_node=min(per, gpus), intra=float(intra or d_intra), inter=float(inter or d_inter))
    if not (c.intra > 0 and c.inter > 0):
        raise PartitionError(f"bandwidths must be > 0 bytes/s, got intra {c.intra} and inter {c.inter}.")
    return c


def tp_cluster(cluster: Cluster, tp: int) -> Cluster:
    """The cluster as the pipeline and the replicas see it under tensor parallelism ``tp``: each tp
    group (tp consecutive ranks of one node, autopipe.choices.world_rank) is one member, a node
    holds gpus_per_node / tp of them, and each link keeps its per-device bandwidth (every tp rank
    sends its own share over its own link, in parallel). tp 1 is the cluster itself."""
    if tp == 1:
        return cluster
    if tp < 1 or cluster.gpus_per_node % tp:
        raise PartitionError(f"--tp {tp} does not divide the node's {cluster.gpus_per_node} devices; use a tp that "
                             f"divides {cluster.gpus_per_node} (tp ranks share a node's fast links).")
    return Cluster(cluster.gpus // tp, cluster.gpus_per_node // tp, cluster.intra, cluster.inter)


def _one_node(stride: int, count: int, per_node: int) -> bool:
    """Whether every group of ``count`` ranks ``stride`` apart lies inside one node. The groups start
    at multiples of ``stride·count`` or, with stride 1, of ``count``: aligned to nodes when the node
    size is a multiple of the group's span."""
    span = count if stride == 1 else stride * count
    return span <= per_node and per_node % span == 0


def place(cluster: Cluster, *, stages: int, dp: int, order: str) -> Placement:
    """The links of a (stages × dp) layout under ``order`` (see the module docstring)."""
    if order not in PLACEMENTS:
        raise PartitionError(f"placement {order!r}; use one of {', '.join(PLACEMENTS)}.")
    if stages * dp != cluster.gpus:
        raise PartitionError(f"{stages} stages x {dp} replicas is {stages * dp} devices, not the cluster's {cluster.gpus}.")
    per = cluster.gpus_per_node
    if order == "pipeline-inner":
        p2p_intra, dp_intra = _one_node(1, stages, per), _one_node(stages, dp, per)
    else:
        p2p_intra, dp_intra = _one_node(dp, stages, per), _one_node(1, dp, per)
    p2p = "none" if stages == 1 else ("intra" if p2p_intra else "inter")
    red = "none" if dp == 1 else ("intra" if dp_intra else "inter")
    bw = {"none": float("inf"), "intra": cluster.intra, "inter": cluster.inter}
    return Placement(order, p2p, red, bw[p2p], bw[red])


def placements(cluster: Cluster, *, stages: int, dp: int) -> list[Placement]:
    """The distinct placements of a layout (one when both orders give the same links)."""
    out: list[Placement] = []
    for order in PLACEMENTS:
        p = place(cluster, stages=stages, dp=dp, order=order)
        if all((q.p2p_link, q.dp_link) != (p.p2p_link, p.dp_link) for q in out):
            out.append(p)
    return out


def all_reduce_time(nbytes: float, members: int, bandwidth: float) -> float:
    """Ring all-reduce: each link carries 2(R−1)/R of the bytes (reduce-scatter, then all-gather)."""
    return 0.0 if members <= 1 else 2.0 * (members - 1) / members * nbytes / bandwidth


def reduce_scatter_time(nbytes: float, members: int, bandwidth: float) -> float:
    """Ring reduce-scatter of ``nbytes`` (the whole tensor) into R shards: (R−1)/R of it per link."""
    return 0.0 if members <= 1 else (members - 1) / members * nbytes / bandwidth


def all_gather_time(nbytes: float, members: int, bandwidth: float) -> float:
    """Ring all-gather into ``nbytes`` (the whole tensor) from R shards: (R−1)/R of it per link."""
    return 0.0 if members <= 1 else (members - 1) / members * nbytes / bandwidth


def dp_reduce_time(grad_bytes: float, weight_bytes: float, members: int, bandwidth: float, zero: int) -> float:
    """One rank's data-parallel traffic per step for its ``grad_bytes`` of gradients and
    ``weight_bytes`` of weights: ZeRO 0/1 all-reduce the gradients (ZeRO 1 updates its shard of the
    optimizer from them); 2 reduce-scatters them and all-gathers the updated weights; 3 also gathers
    the weights once more, for the backward (resharded after the forward)."""
    if zero <= 1:
        return all_reduce_time(grad_bytes, members, bandwidth)
    gathers = 2 if zero == 3 else 1
    return reduce_scatter_time(grad_bytes, members, bandwidth) + gathers * all_gather_time(weight_bytes, members, bandwidth)
