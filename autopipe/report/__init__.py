"""What a person reads: report.html and the tables the CLI prints.

    page            report.html: one self-contained page (inline CSS and SVG, no scripts)
    svg             the drawing kit every chart of the page uses
    search_section  the page's section for a plan that came from the cluster search
    tables          rich tables: a plan's stages, partitioners side by side
    search_tables   rich tables: the cluster search's top layouts
    layer_tables    rich tables: a LayerSequence's layers
    steplog         a training run's step log read back and set beside its plan
    breakdown       where measured steps went (a bench's profile), beside the plan's terms
"""

from __future__ import annotations

from .page import render_report, write_report
from .steplog import Comparison, compare, read_step_log

__all__ = ["Comparison", "compare", "read_step_log", "render_report", "write_report"]
