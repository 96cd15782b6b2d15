"""Patched flow-matching scheduler, launcher-seeded SDE windows, and the schedule as data (`SchedulerSetup`).

Imports nothing else of this project."""

from .flow_match_sde import (
    SDE_TYPES,
    FlowMatchSDEDiscreteScheduler,
    FlowMatchSDESchedulerOutput,
    TimestepNotInScheduleError,
)
from .scheduler_setup import SchedulerSetup, image_seq_len_shift
from .sde_window import SDEWindow, SDEWindowSchedule, draw_sde_window

__all__ = [
    "SDE_TYPES",
    "FlowMatchSDEDiscreteScheduler",
    "FlowMatchSDESchedulerOutput",
    "SDEWindow",
    "SDEWindowSchedule",
    "SchedulerSetup",
    "TimestepNotInScheduleError",
    "draw_sde_window",
    "image_seq_len_shift",
]
