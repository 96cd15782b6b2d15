# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`StepJudge`: the per-step verdict and the alarms, from each step's scalar figures alone.

It needs no tables: the in-loop monitor feeds it the `StepFigures` of each step, and logged series (verl-omni's
``rollout_corr/*``, ours under ``monitor/``) can drive it after the run through `figures_from_scalars`.

For each judged step, in order:

``gap``        the step is not the last judged step + ``step_stride``: the steps between were not judged.
``nonfinite``  the step has a NaN/±inf entry (``nonfinite > 0``) or a NaN/±inf figure.
``verdict``    a gated figure is outside the profile's limit (`TableSettings.tolerance`; the pooled profiles
               allow a bias ``BIAS_NOISE_Z`` standard errors of its mean over samples, as the gate does), or the
               step compared no entry.
``sync``       the same as ``verdict``, on the first step judged after `mark_sync` (a weight sync, a resume):
               the first ratio after a sync left 1 — the trainer's weights may not have reached the rollout.
``drift``      the one-sided CUSUM of the step's drift figure crossed its threshold.

**The drift alarm** (Page's one-sided CUSUM on a floor-normalised statistic). With ``x_s`` the step's
``drift_figure`` (mean |Δlogp| by default) and ``y_s = log10(x_s + drift_epsilon)``: the floor is measured over
the first K = ``warmup_steps`` judged steps whose verdict passed — ``μ = mean(y)``, ``σ = max(std(y, ddof=1),
drift_min_spread)`` — and from then on ``z_s = min((y_s − μ)/σ, c)``, ``S_s = max(0, S_{s−1} + z_s − k)``; the alarm
fires when ``S_s > h`` (k = ``drift_slack``, h = ``drift_threshold``, c = ``drift_z_cap``: one spike adds at most
``c − k``, so it takes ``h/(c − k)`` steps far above the floor to alarm) and ``S`` restarts from 0. The step where ``S`` last
left 0 is reported as where the growth began. A floor of exact zeros (bit-exact agreement over all K steps) is
not noise: the first step whose figure is not 0 raises the drift alarm at once. The floor is measured over the first K clean steps, never at step 1 alone.

Steps must come in increasing order: a repeated or earlier step is a `MonitorError` (a series that goes back is
a resumed run logged twice or two runs mixed; judge each on its own). Memory is bounded whatever the number of
steps: the floor's K values, the CUSUM state, the counts, and the first ``max_alarms_kept`` alarms.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout_consistency.gate.judging.metrics import METRICS
from rollout_consistency.gate.judging.verdict import BIAS_NOISE_Z, within

from .figures import COUNT_NAMES, StepFigures
from .settings import MonitorError, MonitorSettings

__all__ = ["ALARM_KINDS", "Alarm", "DriftFloor", "JudgeSummary", "StepJudge", "StepVerdict"]

#: Every alarm kind, in the order a step is judged (``shape`` comes from the tables: `RunMonitor`).
ALARM_KINDS: tuple[str, ...] = ("shape", "gap", "nonfinite", "verdict", "sync", "drift")


@dataclass(frozen=True)
class Alarm:
    """One alarm: its kind (`ALARM_KINDS`), the step, a one-line message, and the figure behind it."""

    kind: str
    step: int
    message: str
    figure: str | None = None
    value: float | None = None
    limit: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


@dataclass(frozen=True)
class DriftFloor:
    """The drift alarm's floor: ``log10`` mean and spread of the drift figure over the steps it was measured on;
    ``exact`` when the figure was exactly 0 on every one of them."""

    figure: str
    steps: tuple[int, ...]
    mean_log10: float
    spread_log10: float
    exact: bool = False

    @property
    def value(self) -> float:
        """The floor in the figure's unit (``10**mean_log10``, the geometric mean)."""
        return 10.0**self.mean_log10

    def to_dict(self) -> dict[str, Any]:
        return {**vars(self), "steps": list(self.steps), "value": self.value}


@dataclass(frozen=True)
class StepVerdict:
    """The judgement of one step.

    Attributes:
        step: the training step.
        passed: the per-step verdict: every gated figure present within its limit, finite, and an entry compared
            (a ``drift`` or ``gap`` alarm does not fail it).
        alarms: the step's alarms (empty: nothing to report).
        checks: gated figure -> (value, limit, within); figures the input lacks are not checked (`not_checked`).
        not_checked: the profile's gated figures the input did not carry.
        after_sync: whether this is the first step judged after `StepJudge.mark_sync`.
        cusum: the drift CUSUM after this step (None while the floor is being measured).
        figures: the figures judged (name -> value).
    """

    step: int
    passed: bool
    alarms: tuple[Alarm, ...]
    checks: Mapping[str, tuple[float, float, bool]]
    not_checked: tuple[str, ...]
    after_sync: bool
    cusum: float | None
    figures: Mapping[str, float]

    @property
    def alarmed(self) -> bool:
        return bool(self.alarms)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "passed": self.passed,
            "alarms": [a.to_dict() for a in self.alarms],
            "checks": {k: list(v) for k, v in self.checks.items()},
            "not_checked": list(self.not_checked),
            "after_sync": self.after_sync,
            "cusum": self.cusum,
            "figures": dict(self.figures),
        }


@dataclass(frozen=True)
class JudgeSummary:
    """A run's judgement so far: steps judged, alarms (the first ``max_alarms_kept`` in full, all counted)."""

    steps_judged: int
    first_step: int | None
    last_step: int | None
    alarms: tuple[Alarm, ...]
    alarm_counts: Mapping[str, int]
    floor: DriftFloor | None
    failed_steps: int
    notes: tuple[str, ...] = field(default=())

    @property
    def passed(self) -> bool:
        """PASS only when a step was judged and no alarm fired (a monitor that saw nothing never passes)."""
        return self.steps_judged > 0 and not any(self.alarm_counts.values())

    @property
    def reasons(self) -> tuple[str, ...]:
        if self.steps_judged == 0:
            return ("the monitor judged no step: nothing was compared",)
        return tuple(f"step {a.step}: {a.kind}: {a.message}" for a in self.alarms)

    def format(self) -> str:
        """A few lines for a terminal or a CI log."""
        verdict = "PASS" if self.passed else "FAIL"
        span = "" if self.first_step is None else f" (steps {self.first_step}..{self.last_step})"
        lines = [f"run monitor: {verdict}: {self.steps_judged} steps judged{span}, {self.failed_steps} failed"]
        counts = ", ".join(f"{k} {v}" for k, v in self.alarm_counts.items() if v)
        lines.append(f"  alarms: {counts or 'none'}")
        if self.floor is not None:
            f = self.floor
            lines.append(
                f"  drift floor: {f.figure} {f.value:.3g} (log10 {f.mean_log10:.3f} ± {f.spread_log10:.3f}) over "
                f"steps {f.steps[0]}..{f.steps[-1]}"
            )
        lines += [f"  {reason}" for reason in self.reasons[:20]]
        hidden = sum(self.alarm_counts.values()) - min(len(self.alarms), 20)
        if hidden > 0:
            lines.append(f"  ... and {hidden} more alarm(s)")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "steps_judged": self.steps_judged,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "failed_steps": self.failed_steps,
            "alarm_counts": dict(self.alarm_counts),
            "alarms": [a.to_dict() for a in self.alarms],
            "floor": None if self.floor is None else self.floor.to_dict(),
            "notes": list(self.notes),
        }


class StepJudge:
    """Judges a run's steps one after another from their scalar figures (module docstring).

    Args:
        settings ([`MonitorSettings`], *optional*): the profile (``settings.gate``), the drift alarm's parameters
            and the step stride; default `MonitorSettings()`.
    """

    def __init__(self, settings: MonitorSettings | None = None) -> None:
        self.settings = MonitorSettings() if settings is None else settings
        if not isinstance(self.settings, MonitorSettings):
            raise MonitorError(f"settings must be a MonitorSettings, got {type(self.settings).__name__}.")
        self._tolerance = self.settings.gate.tolerance
        self._pooled = self._tolerance.pooled
        self._last: int | None = None
        self._first: int | None = None
        self._judged = 0
        self._failed = 0
        self._sync_pending = False
        self._warm: list[tuple[int, float]] = []
        self._warm_exact = True
        self._floor: DriftFloor | None = None
        self._cusum = 0.0
        self._rise_from: int | None = None
        self._alarms: list[Alarm] = []
        self._counts = dict.fromkeys(ALARM_KINDS, 0)

    @property
    def floor(self) -> DriftFloor | None:
        """The drift floor, once measured over the first ``warmup_steps`` clean steps."""
        return self._floor

    @property
    def last_step(self) -> int | None:
        return self._last

    def mark_sync(self) -> None:
        """The next judged step is the first after a weight sync (or a resume): its verdict FAIL is a ``sync``
        alarm naming the weight sync."""
        self._sync_pending = True

    def judge(
        self, step: int, figures: StepFigures | Mapping[str, float], *, extra_alarms: tuple[Alarm, ...] = ()
    ) -> StepVerdict:
        """Judge one step from its figures.

        Args:
            step (`int`): the training step; each call's must be larger than the last's.
            figures (`StepFigures` or mapping of figure name -> float): the step's figures (`FIGURE_NAMES`, and
                ``entries`` / ``nonfinite`` when known); a mapping may hold only some (a logged series).
            extra_alarms: alarms the caller raised on this step's inputs (`RunMonitor`'s ``shape``); they fail the
                step's verdict and are counted with the others.

        Raises:
            MonitorError: a step that is not an int, not larger than the last judged one, or figures that hold
                none of the profile's gated figures (nothing would be compared).
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise MonitorError(f"step must be an int (the training step), got {step!r}.")
        if self._last is not None and step <= self._last:
            what = "repeated" if step == self._last else f"out of order (after step {self._last})"
            raise MonitorError(
                f"step {step} is {what}: steps must increase (a resumed run logged twice, or two runs in one "
                f"series?); judge each run with its own StepJudge."
            )
        values = _as_mapping(figures)
        settings = self.settings
        alarms: list[Alarm] = list(extra_alarms)
        if self._last is not None and step - self._last != settings.step_stride:
            alarms.append(
                Alarm(
                    "gap",
                    step,
                    f"step {step} follows step {self._last}: {step - self._last - 1} step(s) between were not judged "
                    f"(expected every {settings.step_stride})",
                )
            )

        checks, not_checked, failures = self._checks(values)
        if not checks:
            raise MonitorError(
                f"step {step}: none of the {self._tolerance.profile} profile's gated figures "
                f"({', '.join(self._tolerance.limits)}) is among the figures given ({', '.join(values) or 'none'}); "
                f"nothing would be compared."
            )
        entries = values.get("entries")
        if entries is not None and entries == 0:
            failures.append(("nonempty", f"no entry was compared at step {step}: an empty step proves nothing"))
        nonfinite = values.get("nonfinite", 0.0)
        bad = [name for name, (value, _, _) in checks.items() if not math.isfinite(value)]
        if (nonfinite and nonfinite > 0) or bad or (isinstance(nonfinite, float) and math.isnan(nonfinite)):
            count = f"{int(nonfinite)} NaN/inf log-prob entr{'y' if nonfinite == 1 else 'ies'}" if nonfinite else ""
            figures_text = f"figures not finite: {', '.join(bad)}" if bad else ""
            alarms.append(
                Alarm(
                    "nonfinite",
                    step,
                    "; ".join(t for t in (count, figures_text) if t)
                    + " (find where it turns NaN: rollout_consistency.NanCapture)",
                    figure="nonfinite",
                    value=float(nonfinite),
                )
            )
        passed = not failures and not bad and not (nonfinite and nonfinite > 0) and not extra_alarms
        after_sync = self._sync_pending
        self._sync_pending = False
        if failures:
            kind = "sync" if after_sync else "verdict"
            text = "; ".join(message for _, message in failures)
            if after_sync:
                text = (
                    "the first ratio after the weight sync leaves 1: "
                    + text
                    + " (the trainer's weights may not have reached the rollout: a key prefix loaded with "
                    "strict=False, a LoRA bound to no module, a layer dropped on resume)"
                )
            first = failures[0][0]
            value, limit, _ = checks.get(first, (math.nan, math.nan, False))
            alarms.append(Alarm(kind, step, text, figure=first, value=value, limit=limit))

        cusum = self._drift(step, values, passed, alarms)
        self._last = step
        if self._first is None:
            self._first = step
        self._judged += 1
        self._failed += 0 if passed else 1
        for alarm in alarms:
            self._counts[alarm.kind] += 1
            if len(self._alarms) < settings.max_alarms_kept:
                self._alarms.append(alarm)
        return StepVerdict(step, passed, tuple(alarms), checks, not_checked, after_sync, cusum, values)

    def summary(self) -> JudgeSummary:
        """The run so far (`JudgeSummary.passed` is False until a step was judged)."""
        notes = []
        if self._floor is None and self._judged:
            notes.append(
                f"the drift floor was not measured: fewer than {self.settings.warmup_steps} steps passed their "
                f"verdict, so the drift alarm was not armed"
            )
        return JudgeSummary(
            self._judged,
            self._first,
            self._last,
            tuple(self._alarms),
            dict(self._counts),
            self._floor,
            self._failed,
            tuple(notes),
        )

    # ------------------------------------------------------------------------------------------------
    def _checks(
        self, values: Mapping[str, float]
    ) -> tuple[dict[str, tuple[float, float, bool]], tuple[str, ...], list[tuple[str, str]]]:
        checks: dict[str, tuple[float, float, bool]] = {}
        missing: list[str] = []
        failures: list[tuple[str, str]] = []
        se = values.get("bias_se", math.nan)
        for name, limit in self._tolerance.limits.items():
            if name not in values:
                missing.append(name)
                continue
            metric = METRICS[name]
            value = float(values[name])
            deviation = metric.deviation(value)
            allowance = 0.0
            if self._pooled and metric.scale == "bias" and math.isfinite(se):
                allowance = BIAS_NOISE_Z * se
            ok = within(deviation, limit + allowance)
            checks[name] = (value, limit, ok)
            if not ok:
                shown = metric.deviation_text(deviation) if metric.agreement is not None else f"{name} = {value:.3g}"
                failures.append((name, f"{shown}, {self._tolerance.profile} limit {limit:.3g}"))
        return checks, tuple(missing), failures

    def _drift(self, step: int, values: Mapping[str, float], passed: bool, alarms: list[Alarm]) -> float | None:
        settings = self.settings
        x = values.get(settings.drift_figure)
        if x is None or not math.isfinite(x) or x < 0:
            return None if self._floor is None else self._cusum
        y = math.log10(x + settings.drift_epsilon)
        if self._floor is None:
            if passed:
                self._warm.append((step, y))
                self._warm_exact = self._warm_exact and x == 0
            if len(self._warm) == settings.warmup_steps:
                ys = [v for _, v in self._warm]
                mean = math.fsum(ys) / len(ys)
                spread = math.sqrt(math.fsum((v - mean) ** 2 for v in ys) / (len(ys) - 1)) if len(ys) > 1 else 0.0
                self._floor = DriftFloor(
                    settings.drift_figure,
                    tuple(s for s, _ in self._warm),
                    mean,
                    max(spread, settings.drift_min_spread),
                    exact=self._warm_exact,
                )
                self._warm = []
            return None
        floor = self._floor
        if floor.exact and x > 0:
            alarms.append(
                Alarm(
                    "drift",
                    step,
                    f"{settings.drift_figure} is {x:.3g} at step {step}: it was exactly 0 over steps "
                    f"{floor.steps[0]}..{floor.steps[-1]} (bit-exact agreement) and is not any more",
                    figure=settings.drift_figure,
                    value=x,
                    limit=0.0,
                )
            )
            return self._cusum
        z = min((y - floor.mean_log10) / floor.spread_log10, settings.drift_z_cap)
        before = self._cusum
        self._cusum = max(0.0, before + z - settings.drift_slack)
        if before == 0.0 and self._cusum > 0.0:
            self._rise_from = step
        if self._cusum == 0.0:
            self._rise_from = None
        if self._cusum > settings.drift_threshold:
            since = self._rise_from if self._rise_from is not None else step
            alarms.append(
                Alarm(
                    "drift",
                    step,
                    f"{settings.drift_figure} is drifting up: {x:.3g} at step {step} against a floor of "
                    f"{floor.value:.3g} (steps {floor.steps[0]}..{floor.steps[-1]}); growing since step {since} "
                    f"(CUSUM {self._cusum:.3g} > {settings.drift_threshold:g})",
                    figure=settings.drift_figure,
                    value=x,
                    limit=floor.value,
                )
            )
            self._cusum = 0.0
            self._rise_from = None
            return 0.0
        return self._cusum


def _as_mapping(figures: StepFigures | Mapping[str, float]) -> dict[str, float]:
    if isinstance(figures, StepFigures):
        values = dict(figures.values)
        values.update({name: float(getattr(figures, name)) for name in COUNT_NAMES})
        return values
    if not isinstance(figures, Mapping):
        raise MonitorError(f"figures must be StepFigures or a mapping of name -> float, got {type(figures).__name__}.")
    out: dict[str, float] = {}
    for name, value in figures.items():
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError) as error:
            raise MonitorError(f"figure {name!r} is {value!r}, not a number.") from error
    return out
