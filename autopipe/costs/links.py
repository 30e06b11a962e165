"""The collective figures a profile prices with: its host's measured ones on a CPU, else stated. No torch.

A CPU profile records its host's gloo collectives (``DeviceInfo.links``: collective -> (α seconds, β
bytes/s), measured once per host by autopipe/runtime/checks/links.py: bench/results/gloo-links.md);
tp's all-reduces, ep's all-to-alls and ep's count exchange are then priced at those, not at the
NVLink latencies costs/tp.py and costs/ep.py state for a GPU, nor the 5 GB/s topology.LINKS states
for a CPU. A GPU profile, an estimate for a named GPU, and a profile made before links were
recorded keep the stated figures.

Example:
    >>> from autopipe.costs.layer_costs import DeviceInfo, LayerCost, Profile
    >>> p = Profile(layers=(LayerCost(0, 1.0, 2.0),), device=DeviceInfo(links={"all_reduce": (4e-4, 1e9)}))
    >>> link_latency(p, "all_reduce", 1e-5), link_bandwidth(p, "all_reduce"), link_latency(p, "all_to_all", 2e-5)
    (0.0004, 1000000000.0, 2e-05)
"""

from __future__ import annotations

from .layer_costs import Profile

__all__ = ["link_latency", "link_bandwidth", "measured_links"]


def measured_links(profile: Profile) -> bool:
    """Whether ``profile`` carries its host's measured collective figures (a CPU profile since they were recorded)."""
    return profile.device.type == "cpu" and bool(profile.device.links)


def link_latency(profile: Profile, kind: str, stated: float) -> float:
    """Seconds of one ``kind`` collective's fixed cost: the measured α of a CPU profile, else ``stated``."""
    got = profile.device.links.get(kind) if measured_links(profile) else None
    return float(got[0]) if got else stated


def link_bandwidth(profile: Profile, kind: str) -> float | None:
    """Bytes/s of ``kind`` in the costs' ring formulas, measured on a CPU profile's host; None where
    not measured (the caller's link, topology.LINKS, stands)."""
    got = profile.device.links.get(kind) if measured_links(profile) else None
    return float(got[1]) if got and got[1] > 0 else None
