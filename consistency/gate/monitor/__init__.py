# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The run monitor: the step-1 gate's judgement at every training step (docs/monitor.md).

exact_sum  `ExactSum`: exact float64 sums as one integer, so shards merge in any order, bit for bit
figures    `StepStats` (one step's sufficient statistics, mergeable across shards) -> `StepFigures`
           (ours and verl's names, per-timestep |Δlogp|); `figures_from_scalars` reads logged series back
settings   `MonitorSettings`: the per-step verdict's profile, the drift alarm, the alarm policy, the dumps
judge      `StepJudge`: per-step verdict and the gap / nonfinite / verdict / sync / drift alarms, from the
           scalar figures alone (one-sided CUSUM on log10 of the drift figure, floor over the first K steps)
"""

from __future__ import annotations

from .exact_sum import ExactSum
from .figures import (
    COUNT_NAMES,
    FIGURE_NAMES,
    VERL_NAMES,
    VERL_TIMESTEP_PREFIX,
    StepFigures,
    StepStats,
    StepStatsError,
    TimestepStats,
    figures_from_scalars,
)
from .judge import ALARM_KINDS, Alarm, DriftFloor, JudgeSummary, StepJudge, StepVerdict
from .run_monitor import AlarmRecord, MonitorAlarm, MonitorWarning, RunMonitor
from .settings import ON_ALARM, MonitorError, MonitorSettings

__all__ = [
    "ALARM_KINDS",
    "COUNT_NAMES",
    "FIGURE_NAMES",
    "ON_ALARM",
    "VERL_NAMES",
    "VERL_TIMESTEP_PREFIX",
    "Alarm",
    "AlarmRecord",
    "DriftFloor",
    "ExactSum",
    "JudgeSummary",
    "MonitorAlarm",
    "MonitorError",
    "MonitorSettings",
    "MonitorWarning",
    "RunMonitor",
    "StepFigures",
    "StepJudge",
    "StepStats",
    "StepStatsError",
    "StepVerdict",
    "TimestepStats",
    "figures_from_scalars",
]
