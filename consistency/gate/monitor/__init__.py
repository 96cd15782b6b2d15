# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The run monitor: the step-1 gate's judgement at every training step (docs/monitor.md).

exact_sum  `ExactSum`: exact float64 sums as one integer, so shards merge in any order, bit for bit
figures    `StepStats` (one step's sufficient statistics, mergeable across shards) -> `StepFigures`
           (ours and verl's names, per-timestep |Δlogp|); `figures_from_scalars` reads logged series back
settings   `MonitorSettings`: the per-step verdict's profile, the drift alarm, the alarm policy, the dumps
judge      `StepJudge`: per-step verdict and the gap / nonfinite / verdict / sync / drift alarms, from the
           scalar figures alone (one-sided CUSUM on log10 of the drift figure, floor over the first K steps)
run_monitor  `RunMonitor`: the hooks in a training loop, the trackers, and on an alarm the doctor, a dump, the policy
distributed  `reduce_step_stats`: one step's statistics across torch.distributed ranks, one all_gather, bit for bit
             (`RunMonitor` calls it under ``distributed=True``)
run_logs   `open_run` / `read_run`: a run's logged series from TensorBoard, wandb offline or MLflow file-store files
watch_series  `watch_table`: the watched series of a run, one row per step with what is wrong with the log there
run_watch  `RunWatch`: every logged step judged (``rollout-consistency watch RUN``) -> `WatchResult`

Importing this package imports none of its modules: each name loads its module on first use (the pytest plugin
imports the fixtures module alone).
"""

from __future__ import annotations

from rollout_consistency.base.lazy_face import lazy_face

# The module (under this package) that serves each name, imported on first use.
_SERVED_BY: dict[str, tuple[str, ...]] = {
    "distributed": ("DistributedMonitorError", "reduce_step_stats"),
    "exact_sum": ("ExactSum",),
    "figures": (
        "COUNT_NAMES",
        "FIGURE_NAMES",
        "VERL_NAMES",
        "VERL_TIMESTEP_PREFIX",
        "StepFigures",
        "StepStats",
        "StepStatsError",
        "TimestepStats",
        "figures_from_scalars",
        "label_timestep",
        "timestep_label",
    ),
    "judge": ("ALARM_KINDS", "Alarm", "DriftFloor", "JudgeSummary", "StepJudge", "StepVerdict"),
    "run_logs": ("RunLog", "RunLogError", "RunReader", "open_run", "read_run"),
    "run_monitor": ("AlarmRecord", "MonitorAlarm", "MonitorWarning", "RunMonitor"),
    "run_watch": ("RunWatch", "WatchedStep", "WatchError", "WatchResult"),
    "settings": ("ON_ALARM", "MonitorError", "MonitorSettings"),
    "watch_series": ("WatchedSeries", "WatchTable", "watch_table"),
}
__all__ = sorted(name for names in _SERVED_BY.values() for name in names)
__getattr__, __dir__ = lazy_face(__name__, _SERVED_BY)
