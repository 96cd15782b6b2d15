# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""PASS, or FAIL with every reason.

The verdict is a list of checks. Seven guard the comparison itself and fail closed (a comparison that cannot be trusted never passes):

==============  ==============================================================================
``shapes``      both sides scored the same (samples, window steps); a mismatch is a FAIL
``nonempty``    at least one (sample, step) entry was compared
``distinct``    the two tables are two buffers (not one array, a view of it, or the trainer's output sharing
                the memory of the rollout's), and the trainer left what the rollout stored unchanged
                (`rollout_consistency.gate.judging.aliasing`); equal *values* are not a failure
``finite``      no log-prob is NaN or ±inf, and no figure is
``complete``    every window step is on both sides and every sample has a step
``workers``     every shard of the work came back (a dead worker, retried once, is a FAIL)
``windows``     all rollouts of a prompt group share one SDE window, the one the launcher's seed draws; in the
                step-1 check also: each side's tables are the plan's window wide, at the plan's timesteps
==============  ==============================================================================

and, where the model has experts by timestep (Wan 2.2) and both sides recorded them, ``experts``: every stored
step was scored by the same expert on both sides (`rollout_consistency.gate.judging.experts`).

Then one check per gated metric: the overall figure *and* (``exact``) the figure at every window position
(and at every timestep value) must be within the limit — a pooled tolerance (``kernel``, ``implementation``,
``calibrated``) gates the overall figure, whose false-alarm rate is measured (docs/checker.md), and a pooled
bias only beyond `BIAS_NOISE_Z` standard errors of its mean over samples; the
reason names the figure, its limit, how far over it is, and the steps where it is over. NaN is never within a limit. A tolerance that gates no metric fails:
a check that checks nothing must not pass.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .metrics import METRICS, ConsistencyMetrics, Metric, PerSample, StepMetrics
from .tolerances import Tolerance

GUARD_CHECKS: tuple[str, ...] = ("shapes", "nonempty", "distinct", "finite", "complete", "workers", "windows")

#: In a ``windows`` reason: a side's tables are not the plan's window (`plan_window_problems`)...
PLAN_WINDOW_MARK = "not the plan's window"
#: ... and the two reasons of `window_problems` (a window drawn per request, not per prompt group).
PER_REQUEST_WINDOW_MARKS = ("rollouts used different SDE windows", "did not use the window drawn")
#: A ``schedule`` reason (`unscorable_reason`): the trainer's own scheduler does not hold the timesteps the rollout
#: stored, so it scored nothing of the batch; the doctor reads both lists back (`unscorable_timesteps`).
UNSCORABLE_MARK = "the trainer's scheduler does not hold the timesteps the rollout stored"

#: Under a pooled tolerance a bias (a metric of scale ``"bias"``: ``|ppo_kl|``, ``|ratio_mean − 1|``) fails only when
#: it exceeds its limit by more than this many standard errors of its mean over samples: the mean of a few samples'
#: kernel noise is not zero (a bug's bias is the same in every sample, so its standard error is small).
BIAS_NOISE_Z = 3.0


@dataclass(frozen=True)
class Problem:
    """A reason the comparison itself failed, raised by the pipeline (e.g. a dead worker).

    ``check`` is one of `GUARD_CHECKS`, or another short name for the pipeline stage.
    """

    check: str
    message: str


@dataclass(frozen=True)
class CheckResult:
    """One line of the verdict.

    Attributes:
        name: a metric name or a guard name.
        kind: ``"metric"`` or ``"guard"``.
        passed: whether it holds.
        message: why it failed (empty when it passed).
        value: overall figure (metrics).
        limit: the largest allowed deviation (metrics).
        excess: how far the worst deviation is over the limit (0 when passed; NaN when not finite).
        steps: window positions where the metric is over its limit.
        timesteps: timestep values where it is over its limit.
    """

    name: str
    kind: str
    passed: bool
    message: str = ""
    value: float | None = None
    limit: float | None = None
    excess: float | None = None
    steps: tuple[int, ...] = ()
    timesteps: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "passed": self.passed,
            "message": self.message,
            "value": self.value,
            "limit": self.limit,
            "excess": self.excess,
            "steps": list(self.steps),
            "timesteps": list(self.timesteps),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckResult:
        return cls(
            name=data["name"],
            kind=data["kind"],
            passed=bool(data["passed"]),
            message=data["message"],
            value=None if data["value"] is None else float(data["value"]),
            limit=None if data["limit"] is None else float(data["limit"]),
            excess=None if data["excess"] is None else float(data["excess"]),
            steps=tuple(data["steps"]),
            timesteps=tuple(float(t) for t in data["timesteps"]),
        )


@dataclass(frozen=True)
class Verdict:
    """All checks; ``passed`` only if every one holds."""

    checks: tuple[CheckResult, ...]

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def status(self) -> str:
        return "PASS" if self.passed else "FAIL"

    @property
    def reasons(self) -> tuple[str, ...]:
        return tuple(f"{c.name}: {c.message}" for c in self.checks if not c.passed)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reasons": list(self.reasons), "checks": [c.to_dict() for c in self.checks]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        return cls(tuple(CheckResult.from_dict(c) for c in data["checks"]))


def decide(
    metrics: ConsistencyMetrics | None,
    tolerance: Tolerance,
    problems: Iterable[Problem] = (),
    *,
    guards: Sequence[str] = (),
) -> Verdict:
    """Judge `metrics` against `tolerance`.

    Args:
        metrics: the comparison, or ``None`` when it could not be made (then `problems` says why, and
            every metric check fails as "not evaluated").
        tolerance: the resolved limits.
        problems: pipeline failures (shape mismatch, dead worker, ...); each fails its guard.
        guards: further guards that ran for this comparison (e.g. ``experts`` for a model with experts by
            timestep): listed as passing unless a problem names them.
    """
    problems = tuple(problems)
    if metrics is None and not problems:
        problems = (Problem("nonempty", "no metrics were computed"),)
    by_check: dict[str, list[str]] = {}
    for problem in problems:
        by_check.setdefault(problem.check, []).append(problem.message)

    if metrics is not None:
        if metrics.overall.count == 0:
            by_check.setdefault("nonempty", []).append(
                f"no (sample, step) entry to compare ({metrics.num_samples} samples x {metrics.num_positions} "
                f"window steps); an empty batch proves nothing"
            )
        if metrics.nonfinite:
            by_check.setdefault("finite", []).append(_describe_nonfinite(metrics))
        elif metrics.overall.count and not metrics.overall.is_finite():
            bad = [m for m in metrics.overall.names() if not math.isfinite(metrics.overall.get(m))]
            by_check.setdefault("finite", []).append(f"figures not finite: {', '.join(bad)}")
        if metrics.missing:
            by_check.setdefault("complete", []).append(_describe_missing(metrics))
        if metrics.empty_samples:
            by_check.setdefault("complete", []).append(
                f"samples with no window step on both sides: {_short_list(metrics.empty_samples)}"
            )

    checks = [
        CheckResult(name, "guard", name not in by_check, "; ".join(by_check.get(name, ())))
        for name in (*GUARD_CHECKS, *(g for g in guards if g not in GUARD_CHECKS))
    ]
    checks += [
        CheckResult(name, "guard", False, "; ".join(messages))
        for name, messages in by_check.items()
        if name not in GUARD_CHECKS and name not in guards
    ]
    if not tolerance.limits:
        checks.append(
            CheckResult(
                "gates",
                "guard",
                False,
                "no metric has a limit (every threshold was disabled); a check that gates nothing cannot pass",
            )
        )
    for name, limit in tolerance.limits.items():
        checks.append(_metric_check(METRICS[name], limit, metrics, tolerance.profile, pooled=tolerance.pooled))
    return Verdict(tuple(checks))


# ----------------------------------------------------------------------------------------------------
def _metric_check(
    metric: Metric, limit: float, metrics: ConsistencyMetrics | None, profile: str, *, pooled: bool = False
) -> CheckResult:
    name = metric.name
    if metrics is None or metrics.overall.count == 0:
        return CheckResult(name, "metric", False, "not evaluated: no comparison was made", limit=limit)
    value = metrics.overall.get(name)
    overall_dev = metric.deviation(value)
    over_positions = [s for s in metrics.by_position if not within(metric.deviation(s.values.get(name)), limit)]
    over_timesteps = [s for s in metrics.by_timestep if not within(metric.deviation(s.values.get(name)), limit)]
    worst = max(
        [overall_dev] + [metric.deviation(s.values.get(name)) for s in over_positions + over_timesteps],
        key=lambda d: math.inf if math.isnan(d) else d,
    )
    # Pooled profiles gate the figure over all entries; the steps over the limit are still named on a FAIL. A
    # pooled bias over its limit gets its sampling noise as allowance (within the limit, it passes anyway).
    noisy = pooled and metric.scale == "bias" and not within(overall_dev, limit)
    noise = BIAS_NOISE_Z * bias_standard_error(name, metrics) if noisy else 0.0
    passed = within(overall_dev, limit + noise) and (pooled or (not over_positions and not over_timesteps))
    if passed:
        return CheckResult(name, "metric", True, "", value=value, limit=limit, excess=0.0)
    if pooled:
        worst = overall_dev
    excess = worst - limit if not math.isnan(worst) else math.nan
    message = f"{name} = {_value_text(metric, value)}"
    if metric.agreement is not None:
        message += f" ({metric.deviation_text(overall_dev)})"
    message += f", {profile} limit {limit:.3g}: {_by_how_much(overall_dev, limit)}"
    if noise > 0:
        message += (
            f", beyond {BIAS_NOISE_Z:g} standard errors ({noise:.3g}) of the mean over {metrics.num_samples} samples"
        )
    if over_positions or over_timesteps:
        where = "; per step (reported, not gated) over the limit at " if pooled else "; over the limit at "
        message += where + _describe_steps(metric, over_positions, over_timesteps)
    return CheckResult(
        name,
        "metric",
        False,
        message,
        value=value,
        limit=limit,
        excess=excess,
        steps=tuple(s.position for s in over_positions if s.position is not None),
        timesteps=tuple(s.timestep for s in over_timesteps if s.timestep is not None),
    )


def bias_standard_error(metric: str, metrics: ConsistencyMetrics) -> float:
    """Standard error of the pooled `metric` as a mean over samples: the spread of the per-sample figures
    (sample standard deviation, n − 1) over sqrt(number of samples). 0 with fewer than two samples or a
    non-finite figure (no allowance)."""
    by_sample = metrics.by_sample
    if isinstance(by_sample, PerSample):
        figures = by_sample.figure(metric)[by_sample.counts > 0]
    else:
        figures = np.array([s.values.get(metric) for s in by_sample if s.values.count], dtype=np.float64)
    if figures.size < 2 or not np.isfinite(figures).all():
        return 0.0
    values = figures.tolist()  # Python's float sums, one value at a time, as this figure was always computed
    try:
        error = _standard_error(values)
    except OverflowError:  # squares of figures beyond ~1e154 (|dlogp| of a few hundred under a ratio)
        error = math.inf
    if math.isfinite(error):
        return error
    # Overflowed (an infinite allowance would pass any bias): the same figure on the values over their largest
    # magnitude, scaled back. Values in [-1, 1] have a standard error of at most 1, so this one is finite.
    scale = max(abs(v) for v in values)
    return scale * _standard_error([v / scale for v in values])


def _standard_error(values: list[float]) -> float:
    mean = sum(values) / len(values)
    variance = sum([(v - mean) ** 2 for v in values]) / (len(values) - 1)
    return math.sqrt(variance / len(values))


def within(deviation: float, limit: float) -> bool:
    """A deviation is within its limit only when it is a number no larger than the limit (NaN never is)."""
    return not math.isnan(deviation) and deviation <= limit


def _value_text(metric: Metric, value: float) -> str:
    return f"{value:{metric.message_format}}" if math.isfinite(value) else f"{value:.3g}"


def _by_how_much(dev: float, limit: float) -> str:
    if math.isnan(dev):
        return "not a number"
    if dev <= limit:
        return "within it overall"
    if limit > 0:
        return f"over by {dev - limit:.3g} ({dev / limit:.3g}x the limit)"
    return f"over by {dev:.3g}"


def _describe_steps(metric: Metric, positions: Sequence[StepMetrics], timesteps: Sequence[StepMetrics]) -> str:
    # Timestep entries name the step best (with its window position when unique); positions otherwise.
    entries = timesteps if timesteps else positions
    return _short_list([f"{s.label()} ({_value_text(metric, s.values.get(metric.name))})" for s in entries], limit=8)


def _describe_nonfinite(metrics: ConsistencyMetrics) -> str:
    items = [f"sample {e.sample} step {e.position} {e.side}={e.value}" for e in metrics.nonfinite]
    return f"{len(items)} non-finite log-prob(s): {_short_list(items)}"


def _describe_missing(metrics: ConsistencyMetrics) -> str:
    items = [f"sample {m.sample} step {m.position} (missing on {m.missing_on})" for m in metrics.missing]
    return f"{len(items)} window step(s) present on one side only: {_short_list(items)}"


def _short_list(items: Sequence[Any], limit: int = 6) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f", … ({len(items) - limit} more)" if len(items) > limit else "")


# ----------------------------------------------------------------------------------------------------
def window_problems(
    expected: Sequence[Any] | None,
    starts: Sequence[int],
    groups: Sequence[int],
) -> list[str]:
    """The ``windows`` guard: why the stored windows break the contract (empty when they keep it).

    Args:
        expected: the plan's samples (`SampleSpec`s: index, window_start drawn from the launcher's seed), or
            ``None`` when unknown (trajectory mode: only the within-group rule is checked).
        starts: the window start each rollout actually used, per sample.
        groups: the prompt group of each sample.
    """
    problems = []
    by_group: dict[int, set[int]] = {}
    for start, group in zip(starts, groups, strict=False):
        by_group.setdefault(group, set()).add(int(start))
    split = {g: sorted(s) for g, s in by_group.items() if len(s) > 1}
    if split:
        shown = "; ".join(f"group {g}: starts {s}" for g, s in sorted(split.items())[:4])
        problems.append(
            f"{len(split)} prompt group(s) whose rollouts used different SDE windows ({shown}): every rollout of a "
            f"group must share one window, or the group's reward spread measures timestep bias, not the policy. "
            f"Draw the window per prompt group from the launcher's seed (rollout_consistency.schedulers.draw_sde_window)."
        )
    if expected is not None:
        off = [
            (s.index, s.window_start, int(start))
            for s, start in zip(expected, starts, strict=False)
            if s.window_start != int(start)
        ]
        if off:
            shown = ", ".join(f"sample {i}: expected start {e}, got {g}" for i, e, g in off[:4])
            problems.append(
                f"{len(off)} rollout(s) did not use the window drawn from (seed, global_step, prompt group) ({shown}"
                f"{', …' if len(off) > 4 else ''}): the rollout's window must be a function of explicit launcher "
                f"arguments only."
            )
    return problems


#: Timesteps match the plan's schedule within float32 rounding of a value computed another way (a few ulp of
#: 1000), or, stored as whole numbers, within the truncation to one (`plan_window_problems`); a wrong schedule,
#: step or a bf16 round trip differs by far more (adjacent steps of an n-step schedule differ by ~1000 / n).
TIMESTEP_RTOL, TIMESTEP_ATOL = 1e-5, 1e-4


def plan_window_problems(
    side: str,
    table: np.ndarray,
    planned_size: int,
    samples: Sequence[int],
    *,
    timesteps: np.ndarray | None = None,
    expected: np.ndarray | None = None,
) -> list[str]:
    """The ``windows`` guard against the plan: why `side`'s ``(n, W)`` table is not the plan's window.

    Args:
        side: ``"rollout"`` or ``"trainer"`` (named in the reason).
        table: the side's log-prob table, ``(n, W)``.
        planned_size: the plan's window size (every sample's).
        samples: the global index of each row.
        timesteps, expected: the side's ``(n, W)`` timesteps and the plan's schedule at each sample's window,
            ``(n, planned_size)`` (compared when both are given and the widths agree).
    """
    n, width = np.shape(table)[0], np.shape(table)[1]
    where = f"samples {samples[0]}-{samples[-1]}" if len(samples) > 1 else f"sample {samples[0]}" if samples else ""
    if width != planned_size:
        return [
            f"{side} side: {PLAN_WINDOW_MARK}: its tables are {width} steps wide, the plan's SDE window {planned_size} "
            f"({where}): it sampled or scored other steps than the plan asked for; take each sample's window from "
            f"the request (request.windows), or run the check with --sde-window-size all for a {side} that uses "
            f"the SDE on every step"
        ]
    if timesteps is None or expected is None or np.shape(timesteps) != np.shape(expected) or n == 0:
        return []
    got, want = np.asarray(timesteps, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    off = ~np.isclose(got, want, rtol=TIMESTEP_RTOL, atol=TIMESTEP_ATOL)
    # A side that stores whole-number timesteps (DanceGRPO's int(sigma * 1000)) matches the plan's step it truncated
    # or rounded; another step of a schedule of <= a few hundred steps lies several units away.
    off &= ~((got == np.round(got)) & (np.abs(got - want) < 1.0))
    if not off.any():
        return []
    rows, cols = np.nonzero(off)
    shown = ", ".join(
        f"sample {samples[i]} step {j}: {got[i, j]:.6g}, the plan's {want[i, j]:.6g}"
        for i, j in zip(rows[:3].tolist(), cols[:3].tolist(), strict=True)
    )
    return [
        f"{side} side: {PLAN_WINDOW_MARK}: its timesteps differ from the plan's schedule at {int(off.sum())} of "
        f"{off.size} stored steps ({shown}{', …' if rows.size > 3 else ''}): it sampled on another schedule (other "
        f"num_inference_steps, shift or sigmas) or maps steps to timesteps another way; build the schedule from "
        f"the request (request.scheduler_setup) and store each step's own timestep"
    ]


def unscorable_reason(owner: str, missing: Sequence[float], schedule: Sequence[float]) -> str:
    """The ``schedule`` guard's reason: the timesteps `owner`'s scheduler was asked for and does not hold
    (`missing`), and the timesteps it holds (`schedule`), both in full (float32 values as Python floats, read back
    exactly by `unscorable_timesteps`)."""
    return (
        f"{owner}: {UNSCORABLE_MARK}: {list(dict.fromkeys(missing))} are not among its {len(schedule)} timesteps "
        f"{list(schedule)}; its scheduler was set up on another schedule than the rollout's"
    )


def unscorable_timesteps(message: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """``(missing, the trainer's schedule)`` from a ``schedule`` guard's reason (`unscorable_reason`), else None."""
    found = re.search(r": \[([^\]]*)\] are not among its \d+ timesteps \[([^\]]*)\]", message)
    if UNSCORABLE_MARK not in message or found is None:
        return None
    missing, schedule = (tuple(float(v) for v in part.split(",") if v.strip()) for part in found.groups())
    return missing, schedule
