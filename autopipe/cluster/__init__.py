"""The cluster search: the layout of N devices (stages x replicas, micro-batches, schedule, ZeRO,
placement on nodes) with the highest predicted throughput. No torch.

    layout_search  search, and why nothing fits when no layout does
    evaluate       one layout solved; the cheap bounds that prune the rest
    layouts        Layout and SearchResult (saved as plan.search.json), the enumeration
    topology       nodes, links and the collectives' times
    hints          why a layout ranks below the best, in words
"""

from __future__ import annotations

from .evaluate import evaluate
from .layout_search import search
from .layouts import SEARCH_SCHEDULES, Layout, SearchResult, search_path
from .topology import Cluster, cluster_for

__all__ = ["Cluster", "Layout", "SEARCH_SCHEDULES", "SearchResult", "cluster_for", "evaluate", "search", "search_path"]
