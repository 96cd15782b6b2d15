# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Which of a run's logged series measure rollout/trainer consistency, and their figures step by step.

`watch_table` turns a `RunLog` (`run_logs`) into one row per training step: the watched figures at that step
and what is wrong with the log there. Watched, each possibly behind a prefix ending in ``/`` (this checker's
step-1 reports log under ``step1/``):

* verl-omni's (``compute_rollout_corr_metrics_from_logprobs``, logged once per global batch at the trainer's
  ``global_steps`` whenever the rollout returns log-probs and bypass mode is off) and verl's rollout correction
  names, `figures.VERL_NAMES`: ``rollout_corr/logprob_abs_diff_mean`` / ``_max`` (mean and max of
  |old_log_probs − rollout_log_probs| over the batch's entries), ``rollout_corr/kl``, ``k3_kl``, the χ² and PPL
  family; and ``rollout_corr/logprob_abs_diff/ts_<t>`` (the mean over the entries of timestep value ``t``);
* the run monitor's own, under its prefix only (``monitor/`` by default): ``monitor/<figure>`` for every figure
  and count of `figures.FIGURE_NAMES` / `COUNT_NAMES`, and ``monitor/max_abs_dlogp_per_ts/ts_<t>``;
* a logged verdict of this checker: ``verdict/passed`` (1 PASS, 0 FAIL).

Not watched, on purpose: ``actor/...`` (verl-omni's loss figures and bypass mode's ``actor/rollout_corr/...``
are measured against the policy being updated, whose ratio leaves 1 by design after the first update) and this
checker's ``.../timestep/...`` series (their step is a row of one report, not a training step).

What is wrong with a log is a step's ``problems`` — never dropped, never a PASS: a point logged twice at one
step, a step logged after a later one, a NaN or inf, and a gap (a step where the run logged other watched
figures but not this one, after this series' first step). Per-timestep series may come and go: the set of
timestep values in a batch changes when each sample's SDE window is drawn at random.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from .figures import (
    COUNT_NAMES,
    FIGURE_NAMES,
    MAX_TIMESTEP_PREFIX,
    VERL_NAMES,
    VERL_TIMESTEP_PREFIX,
    label_timestep,
)
from .run_logs import RunLog

__all__ = ["DEFAULT_PREFIX", "StepRow", "WatchTable", "WatchedSeries", "watch_table", "watched"]

#: The run monitor's prefix unless the caller names another (`MonitorSettings.prefix`'s default).
DEFAULT_PREFIX = "monitor/"

_VERL = frozenset(VERL_NAMES.values())
_OURS = frozenset(FIGURE_NAMES + COUNT_NAMES)
_VERDICT = "verdict/passed"
_TIMESTEP = re.compile(r"^(?P<prefix>(?:.*/)?)" + re.escape(VERL_TIMESTEP_PREFIX) + r"(?P<t>[-+0-9.eE]+)$")
_NOT_WATCHED = (
    (re.compile(r"(^|/)actor/"), "measured inside the loss against the policy being updated (bypass mode)"),
    (re.compile(r"/timestep/"), "a per-timestep row of one report (its step is the row, not a training step)"),
)


@dataclass(frozen=True)
class WatchedSeries:
    """One watched series: its logged ``name``, the ``figure`` it is (ours, a verl name, or ``"verdict"``), its
    ``prefix`` (``""`` for verl-omni's) and, for a per-timestep series, the ``timestep`` value."""

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


def watched(name: str, prefix: str = DEFAULT_PREFIX) -> WatchedSeries | None:
    """The `WatchedSeries` a logged name is (the run monitor's names under `prefix`), or None."""
    if any(pattern.search(name) for pattern, _ in _NOT_WATCHED):
        return None
    found = _TIMESTEP.match(name)
    if found is not None:
        t = label_timestep(found.group("t"))
        return None if t is None else WatchedSeries(name, "mean_abs_dlogp", found.group("prefix"), t)
    if prefix and name.startswith(prefix):
        bare = name[len(prefix) :]
        if bare in _OURS:
            return WatchedSeries(name, bare, prefix)
        if bare.startswith(MAX_TIMESTEP_PREFIX):
            t = label_timestep(bare[len(MAX_TIMESTEP_PREFIX) :])
            return None if t is None else WatchedSeries(name, "max_abs_dlogp", prefix, t)
    for known in (*_VERL, _VERDICT):
        if name == known or name.endswith("/" + known):
            figure = "verdict" if known == _VERDICT else known
            return WatchedSeries(name, figure, name[: len(name) - len(known)])
    return None


def watch_table(log: RunLog, prefix: str = DEFAULT_PREFIX) -> WatchTable:
    """The watched series of `log` (the run monitor's under `prefix`) and one `StepRow` per step any of them was
    logged at (module docstring)."""
    series = tuple(s for s in (watched(name, prefix) for name in sorted(log.series)) if s is not None)
    ignored = {
        name: why
        for name in log.series
        for pattern, why in _NOT_WATCHED
        if pattern.search(name) and watched(_unwatched(name), prefix) is not None
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


def _unwatched(name: str) -> str:
    """The name less what made it not watched (``actor/``, ``.../timestep/``): is it a consistency figure?"""
    return re.sub(r"^(.*/)?(actor|timestep)/", "", name)
