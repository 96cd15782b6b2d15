"""Patched flow-matching scheduler and launcher-seeded SDE windows."""

from .flow_match_sde import SDE_TYPES, FlowMatchSDEDiscreteScheduler, FlowMatchSDESchedulerOutput
from .sde_window import SDEWindow, SDEWindowSchedule, draw_sde_window

__all__ = [
    "SDE_TYPES",
    "FlowMatchSDEDiscreteScheduler",
    "FlowMatchSDESchedulerOutput",
    "SDEWindow",
    "SDEWindowSchedule",
    "draw_sde_window",
]
