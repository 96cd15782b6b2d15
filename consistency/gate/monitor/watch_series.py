# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Which of a run's logged series measure rollout/trainer consistency, and their figures step by step.

`watch_table` turns a `RunLog` (`run_logs`) into one row per training step: the watched figures at that step
and what is wrong with the log there. A series is watched when its name, after an optional prefix ending in
``/`` (``step1/`` is this checker's default), is one of `WATCHED_NAMES` or verl-omni's per-timestep
``rollout_corr/logprob_abs_diff/ts_<t>``:

* verl-omni (``compute_rollout_corr_metrics_from_logprobs``, logged once per global batch at the trainer's
  ``global_steps`` whenever the rollout returns log-probs and bypass mode is off):
  ``rollout_corr/logprob_abs_diff_mean`` / ``_max`` (mean and max of |old_log_probs − rollout_log_probs| over
  every entry of the batch), ``rollout_corr/logprob_abs_diff/ts_<t>`` (the mean over the entries whose
  timestep value is ``t``, formatted ``%.4g``), and verl's ``rollout_corr/kl``, ``k3_kl`` and PPL family;
* this checker's (`judging.loggers`, `Report.log_to`): the same ``rollout_corr/...`` names where the figure is
  that definition, ``consistency/max_abs_dlogp`` and ``consistency/mean_abs_dlogp`` (per-cell means,
  averaged), and ``verdict/passed`` (1 PASS, 0 FAIL).

Not watched, on purpose: ``actor/rollout_corr/...`` (bypass mode: measured inside the loss against the
policy being updated, whose ratio leaves 1 by design after the first update) and this checker's
``.../timestep/...`` series (their step is a row of one report, not a training step).

What is wrong with a log is a step's ``problems`` — never dropped, never a PASS: a point logged twice at one
step, a step logged after a later one, a NaN or inf, and a gap (a step where the run logged other watched
figures but not this one, after this series' first step). Per-timestep series may come and go: the
set of timestep values in a batch changes when each sample's SDE window is drawn at random.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .run_logs import RunLog

__all__ = ["TIMESTEP_SERIES", "WATCHED_NAMES", "StepRow", "WatchTable", "WatchedSeries", "watch_table"]

#: A logged name (less its prefix) -> (the figure it is, whose definition). The figure picks the limit.
WATCHED_NAMES: Mapping[str, tuple[str, str]] = {
    "rollout_corr/logprob_abs_diff_max": ("max_abs_dlogp", "max |old − rollout log-prob| over the batch (verl-omni)"),
    "consistency/max_abs_dlogp": ("max_abs_dlogp", "max |Δlogp| over the table (this checker's gated figure)"),
    "rollout_corr/logprob_abs_diff_mean": ("mean_abs_dlogp", "mean |Δlogp| over every entry (verl-omni)"),
    "consistency/mean_abs_dlogp": ("mean_abs_dlogp", "mean |Δlogp|, per-cell means averaged (this checker's)"),
    "rollout_corr/kl": ("kl", "mean(rollout − old log-prob), KL(rollout ‖ old) (verl's rollout correction)"),
    "rollout_corr/k3_kl": ("k3_kl", "mean(exp(r) − r − 1), r = old − rollout (verl's rollout correction)"),
    "rollout_corr/log_ppl_abs_diff": ("log_ppl_abs_diff", "mean |per-sample mean log-prob gap| (verl)"),
    "verdict/passed": ("verdict", "this checker's logged verdict: 1 PASS, 0 FAIL"),
}

#: verl-omni's per-timestep series: ``rollout_corr/logprob_abs_diff/ts_<t>``, ``t`` the timestep value.
TIMESTEP_SERIES = re.compile(r"^(?P<prefix>(?:.*/)?)rollout_corr/logprob_abs_diff/ts_(?P<t>[-+0-9.eE]+|nan|inf)$")

_NOT_WATCHED = (
    (re.compile(r"(^|/)actor/rollout_corr/"), "bypass mode's figure, measured against the policy being updated"),
    (re.compile(r"/timestep/"), "a per-timestep row of one report (its step is the row, not a training step)"),
)


@dataclass(frozen=True)
class WatchedSeries:
    """One watched series: its logged ``name``, the ``figure`` it is (a key of the limits), its ``prefix``
    (``""`` for verl-omni's) and, for a per-timestep series, the ``timestep`` value."""

    name: str
    figure: str
    prefix: str
    timestep: float | None = None


@dataclass(frozen=True)
class StepRow:
    """One training step: ``values`` (logged name -> the value logged at it; the last one when logged twice)
    and ``problems`` (one line each: what is wrong with the log at this step)."""

    step: int
    values: Mapping[str, float]
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class WatchTable:
    """A run's watched series and its rows in step order. ``ignored``: logged name -> why it is not watched,
    for the names that look like consistency figures but are not (bypass mode's, per-row series)."""

    path: str
    kind: str
    series: tuple[WatchedSeries, ...]
    rows: tuple[StepRow, ...]
    ignored: Mapping[str, str]
    ended: str | None = None


def watched(name: str) -> WatchedSeries | None:
    """The `WatchedSeries` a logged name is, or None."""
    if any(pattern.search(name) for pattern, _ in _NOT_WATCHED):
        return None
    found = TIMESTEP_SERIES.match(name)
    if found is not None:
        return WatchedSeries(name, "mean_abs_dlogp", found.group("prefix"), float(found.group("t")))
    for known, (figure, _) in WATCHED_NAMES.items():
        if name == known or name.endswith("/" + known):
            return WatchedSeries(name, figure, name[: len(name) - len(known)])
    return None


def watch_table(log: RunLog) -> WatchTable:
    """The watched series of `log` and one `StepRow` per step any of them was logged at (see the module)."""
    series = tuple(s for s in (watched(name) for name in sorted(log.series)) if s is not None)
    ignored = {
        name: why
        for name in log.series
        for pattern, why in _NOT_WATCHED
        if pattern.search(name) and ("rollout_corr/" in name or "consistency/" in name)
    }
    values: dict[int, dict[str, float]] = {}
    problems: dict[int, list[str]] = {}
    for one in series:
        points = log.series[one.name]
        latest = None
        seen: dict[int, float] = {}
        for step, value in points:
            if step in seen:
                problems.setdefault(step, []).append(
                    f"{one.name} logged twice at step {step} ({_show(seen[step])}, then {_show(value)})"
                )
            elif latest is not None and step < latest:
                problems.setdefault(step, []).append(f"{one.name} at step {step} was logged after step {latest}")
            if not math.isfinite(value):
                problems.setdefault(step, []).append(f"{one.name} is {_show(value)} at step {step}")
            seen[step] = value
            latest = step if latest is None else max(latest, step)
            values.setdefault(step, {})[one.name] = value
    steps = sorted(values)
    for one in series:
        if one.timestep is not None:
            continue  # the timestep values in a batch may change from step to step
        first = min(step for step, _ in log.series[one.name])
        for step in steps:
            if step > first and one.name not in values[step]:
                problems.setdefault(step, []).append(
                    f"{one.name} is missing at step {step} (a gap: it was logged from step {first} on)"
                )
    rows = tuple(StepRow(step, values[step], tuple(problems.get(step, ()))) for step in steps)
    return WatchTable(log.path, log.kind, series, rows, ignored, log.ended)


def _show(value: float) -> str:
    return f"{value:.6g}"
