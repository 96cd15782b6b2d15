# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A run judged after the fact from its logged series: a verdict and alarms at every step, the first alarm and a
likely cause, as text, JSON, JUnit and a per-step plot.

::

    watcher = RunWatch(MonitorSettings(gate=TableSettings(profile="kernel")))
    result = watcher.update(watch_table(read_run("tensorboard_log/proj/exp")), final=True)
    result.passed, result.first_alarm, result.format()

Each source of figures — verl-omni's ``rollout_corr/*``, the run monitor's ``monitor/*``, a step-1 report's
``step1/*``: the series sharing a prefix (`watch_series`) — is judged by its own `StepJudge` (the per-step
verdict against the profile, the gap, non-finite, verdict and drift alarms), from the step's figures read by
`figures_from_scalars`. To those a run adds its own alarms (kind ``log``): a series logged twice at a step, out of
order, NaN, with a gap, two series of one figure that disagree, a step whose figures hold no gated figure; and a
logged step-1 verdict of FAIL (kind ``verdict``).

`RunWatch.update` judges the rows it has not judged yet, so ``--follow`` feeds it the growing table: a row is
judged once a later step was logged or the run ended (its series may still be arriving), and a problem found
later at a step already judged (a resumed run logging it again) is an alarm then. A run whose files hold no
watched series raises `WatchError`: nothing compared is never a PASS.

The likely cause at the first alarm reads the per-timestep series: each timestep value's mean |Δlogp| against its
own level over the drift floor's steps (or the first steps judged): grown at a few timesteps points at those
timesteps (a schedule or sigma mismatch there; verl-omni: later steps and guidance amplify the gap), grown at
every timestep at the model as a whole (weights not synced, another attention backend or dtype).
"""

from __future__ import annotations

import math
import os
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .figures import StepStatsError, figures_from_scalars, timestep_label
from .judge import Alarm, JudgeSummary, StepJudge, StepVerdict
from .settings import MonitorError, MonitorSettings
from .watch_series import StepRow, WatchedSeries, WatchTable

__all__ = ["WATCH_FORMAT", "RunWatch", "WatchError", "WatchResult", "WatchedStep"]

#: The JSON report's ``format``.
WATCH_FORMAT = "rollout-consistency/watch"
_GROWN = 10.0  # a timestep's mean |Δlogp| this many times its own level counts as grown


class WatchError(ValueError):
    """A run that cannot be judged: it holds no watched series, or no step of them; the message names the fix."""


@dataclass(frozen=True)
class WatchedStep:
    """One judged step: each source's `StepVerdict` (by prefix, ``""`` for verl-omni's names), every alarm of the
    step (the judges' and the run's own, kind ``log``), and the per-timestep mean |Δlogp| logged at it."""

    step: int
    verdicts: Mapping[str, StepVerdict]
    alarms: tuple[Alarm, ...]
    by_timestep: Mapping[float, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return not self.alarms and bool(self.verdicts) and all(v.passed for v in self.verdicts.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "passed": self.passed,
            "alarms": [a.to_dict() for a in self.alarms],
            "figures": {source or "verl": dict(v.figures) for source, v in self.verdicts.items()},
            "by_timestep": {timestep_label(t): value for t, value in self.by_timestep.items()},
        }


@dataclass(frozen=True)
class WatchResult:
    """A run's judgement: every judged step, each source's `JudgeSummary`, the first alarm and its likely cause."""

    path: str
    kind: str
    profile: str
    steps: tuple[WatchedStep, ...]
    summaries: Mapping[str, JudgeSummary]
    sources: Mapping[str, tuple[str, ...]]
    ignored: Mapping[str, str]
    ended: str | None
    cause: str | None
    late_alarms: tuple[Alarm, ...] = ()
    limits: Mapping[str, float] = field(default_factory=dict)

    @property
    def alarms(self) -> tuple[Alarm, ...]:
        return tuple(a for s in self.steps for a in s.alarms) + self.late_alarms

    @property
    def passed(self) -> bool:
        """PASS only when a step was judged and nothing alarmed."""
        return bool(self.steps) and not self.alarms

    @property
    def first_alarm(self) -> Alarm | None:
        alarms = self.alarms
        return min(alarms, key=lambda a: a.step) if alarms else None

    def format(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        span = f"steps {self.steps[0].step}..{self.steps[-1].step}" if self.steps else "no step"
        sources = "; ".join(f"{source or 'verl-omni'} ({len(names)} series)" for source, names in self.sources.items())
        lines = [
            f"watch {self.path} ({self.kind}): {status}: {len(self.steps)} steps judged ({span}), profile "
            f"{self.profile}; sources: {sources}"
        ]
        first = self.first_alarm
        if first is not None:
            lines.append(f"  first alarm: step {first.step}: {first.kind}: {first.message}")
            if self.cause:
                lines.append(f"  likely cause: {self.cause}")
        counts: dict[str, int] = {}
        for alarm in self.alarms:
            counts[alarm.kind] = counts.get(alarm.kind, 0) + 1
        lines.append("  alarms: " + (", ".join(f"{k} {v}" for k, v in counts.items()) or "none"))
        failed = [s.step for s in self.steps if not s.passed]
        if failed:
            shown = ", ".join(map(str, failed[:12])) + (f" ... ({len(failed)} in all)" if len(failed) > 12 else "")
            lines.append(f"  steps with an alarm: {shown}")
        for source, summary in self.summaries.items():
            if summary.floor is not None:
                f = summary.floor
                lines.append(
                    f"  drift floor ({source or 'verl-omni'}): {f.figure} {f.value:.3g} over steps "
                    f"{f.steps[0]}..{f.steps[-1]}"
                )
            lines += [f"  note ({source or 'verl-omni'}): {note}" for note in summary.notes]
        for name, why in list(self.ignored.items())[:3]:
            lines.append(f"  not judged: {name}: {why}")
        if self.ended is None:
            lines.append("  the run has not marked its end (still running, or TensorBoard, which has no end mark)")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_alarm
        return _strict(
            {
                "format": WATCH_FORMAT,
                "version": 1,
                "status": "PASS" if self.passed else "FAIL",
                "passed": self.passed,
                "run": {"path": self.path, "kind": self.kind, "ended": self.ended},
                "profile": self.profile,
                "first_alarm": None if first is None else first.to_dict(),
                "likely_cause": self.cause,
                "sources": {source or "verl": list(names) for source, names in self.sources.items()},
                "summaries": {source or "verl": s.to_dict() for source, s in self.summaries.items()},
                "late_alarms": [a.to_dict() for a in self.late_alarms],
                "ignored": dict(self.ignored),
                "steps": [s.to_dict() for s in self.steps],
            }
        )

    def junit_xml(self) -> str:
        """JUnit XML: one ``<testcase>`` per judged step (a ``<failure>`` per alarmed one), plus one for the
        alarms found later at steps already judged."""
        failures = sum(1 for s in self.steps if not s.passed) + (1 if self.late_alarms else 0)
        tests = len(self.steps) + (1 if self.late_alarms else 0)
        suites = ET.Element("testsuites", name="rollout-consistency", tests=str(tests), failures=str(failures))
        suite = ET.SubElement(
            suites, "testsuite", name=f"watch[{self.profile}]", tests=str(tests), failures=str(failures), errors="0"
        )
        properties = ET.SubElement(suite, "properties")
        for key, value in (("run", self.path), ("format", self.kind), ("profile", self.profile)):
            ET.SubElement(properties, "property", name=key, value=str(value))
        classname = f"rollout-consistency.watch.{self.profile}"
        cases = [(f"step {s.step}", s.alarms) for s in self.steps]
        if self.late_alarms:
            cases.append(("steps logged again later", self.late_alarms))
        for name, alarms in cases:
            case = ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")
            if alarms:
                failure = ET.SubElement(case, "failure", message=f"{alarms[0].kind}: {alarms[0].message}", type="Alarm")
                failure.text = "\n".join(f"{a.kind}: {a.message}" for a in alarms)
        out = ET.SubElement(suite, "system-out")
        out.text = self.format()
        ET.indent(suites)
        return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"

    def write_plot(self, path: str | os.PathLike[str]) -> None:
        """PNG: mean and max |Δlogp| per step (log scale) with the profile's limits and the drift floor, the
        alarmed steps marked; below, each timestep value's mean |Δlogp| per step."""
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure

        fig = Figure(figsize=(9, 6.5), dpi=100)
        top, bottom = fig.subplots(2, 1, sharex=True)
        fig.suptitle(
            f"watch: {'PASS' if self.passed else 'FAIL'} (profile {self.profile})",
            color="tab:green" if self.passed else "tab:red",
        )
        steps = [s.step for s in self.steps]
        for source in self.sources:
            for figure, style in (("mean_abs_dlogp", "o-"), ("max_abs_dlogp", "s--")):
                points = [
                    (s.step, s.verdicts[source].figures.get(figure))
                    for s in self.steps
                    if source in s.verdicts and s.verdicts[source].figures.get(figure) is not None
                ]
                points = [(x, y) for x, y in points if math.isfinite(y) and y > 0]
                if points:
                    xs, ys = zip(*points, strict=True)
                    top.plot(xs, ys, style, markersize=3, label=f"{source or 'verl-omni'} {figure}")
            summary = self.summaries.get(source)
            if summary is not None and summary.floor is not None:
                top.axhline(summary.floor.value, color="grey", linestyle=":", label="drift floor")
        for figure, limit in self.limits.items():
            if figure in ("mean_abs_dlogp", "max_abs_dlogp") and limit > 0:
                top.axhline(limit, color="tab:red", linewidth=0.8, linestyle="-.", label=f"{figure} limit {limit:g}")
        for alarm_step in sorted({a.step for a in self.alarms}):
            top.axvline(alarm_step, color="tab:red", alpha=0.25)
            bottom.axvline(alarm_step, color="tab:red", alpha=0.25)
        first = self.first_alarm
        if first is not None:
            top.set_title(f"first alarm: step {first.step} ({first.kind})", fontsize=9)
        _log_scale(top)
        top.set_ylabel("|Δlogp| per step")
        top.legend(fontsize=7)
        timesteps = sorted({t for s in self.steps for t in s.by_timestep}, reverse=True)
        for t in timesteps:
            points = [(s.step, s.by_timestep[t]) for s in self.steps if t in s.by_timestep]
            points = [(x, y) for x, y in points if math.isfinite(y) and y > 0]
            if points:
                xs, ys = zip(*points, strict=True)
                bottom.plot(xs, ys, "-", linewidth=1, label=f"t={timestep_label(t)}")
        if not timesteps:
            bottom.text(0.5, 0.5, "no per-timestep series", ha="center", va="center", transform=bottom.transAxes)
        else:
            _log_scale(bottom)
            bottom.legend(fontsize=6, ncol=max(1, len(timesteps) // 8))
        bottom.set_ylabel("mean |Δlogp| per timestep")
        bottom.set_xlabel("training step")
        if steps:
            bottom.set_xlim(min(steps) - 0.5, max(steps) + 0.5)
        fig.tight_layout()
        fig.savefig(path, format="png")


class RunWatch:
    """Judges a run's rows as they come (`update`); one `StepJudge` per source of figures.

    Args:
        settings ([`MonitorSettings`]): the profile, the drift alarm and the step stride (the prefix of the run
            monitor's names is ``settings.prefix``).
    """

    def __init__(self, settings: MonitorSettings | None = None) -> None:
        self.settings = MonitorSettings() if settings is None else settings
        self._judges: dict[str, StepJudge] = {}
        self._steps: list[WatchedStep] = []
        self._seen_problems: dict[int, set[str]] = {}
        self._late: list[Alarm] = []

    def update(self, table: WatchTable, *, final: bool) -> WatchResult:
        """Judge the rows of `table` not judged yet (all of them when `final` or the run ended, else all but the
        last step's, whose series may still be arriving). Raises `WatchError` when `final` and the table holds no
        watched series or no step."""
        sources = _sources(table.series)
        if final and not sources:
            raise WatchError(_nothing_to_judge(table))
        last = self._steps[-1].step if self._steps else None
        complete = final or table.ended is not None
        rows = [r for r in table.rows if last is None or r.step > last]
        if not complete and rows:
            rows = rows[:-1]
        for row in table.rows:  # problems that appeared at steps already judged (logged again later)
            if last is not None and row.step <= last:
                new = set(row.problems) - self._seen_problems.get(row.step, set())
                for problem in sorted(new):
                    self._late.append(Alarm("log", row.step, problem))
                self._seen_problems.setdefault(row.step, set()).update(new)
        for row in rows:
            self._steps.append(self._judge_row(row, table.series, sources))
            self._seen_problems[row.step] = set(row.problems)
        if final and not self._steps:
            raise WatchError(f"{table.path} holds watched series but no step of them to judge; nothing was compared.")
        return self._result(table, sources)

    def _judge_row(self, row: StepRow, series: tuple[WatchedSeries, ...], sources: Mapping[str, Any]) -> WatchedStep:
        alarms = [Alarm("log", row.step, problem) for problem in row.problems]
        verdicts: dict[str, StepVerdict] = {}
        for source, members in sources.items():
            scalars = {s.name[len(source) :]: row.values[s.name] for s in members if s.name in row.values}
            scalars = {name: value for name, value in scalars.items() if "/ts_" not in name}
            logged_verdict = scalars.pop("verdict/passed", None)
            if logged_verdict is not None and logged_verdict != 1.0:
                alarms.append(
                    Alarm(
                        "verdict",
                        row.step,
                        f"{source}verdict/passed = {logged_verdict:g}: the step-1 report logged at this step did "
                        f"not PASS",
                        figure="verdict/passed",
                        value=logged_verdict,
                    )
                )
            if not scalars:
                continue
            try:
                figures = figures_from_scalars(scalars, prefix="")
            except StepStatsError as error:
                alarms.append(Alarm("log", row.step, f"{source or 'verl-omni'}: {error}"))
                continue
            judge = self._judges.setdefault(source, StepJudge(self.settings))
            try:
                verdict = judge.judge(row.step, figures)
            except MonitorError as error:
                alarms.append(Alarm("log", row.step, f"{source or 'verl-omni'}: {error}"))
                continue
            verdicts[source] = verdict
            alarms.extend(verdict.alarms)
        by_timestep = {
            s.timestep: row.values[s.name]
            for s in series
            if s.timestep is not None and s.figure == "mean_abs_dlogp" and s.name in row.values
        }
        if not verdicts and not any(a.kind == "verdict" for a in alarms) and not row.problems:
            alarms.append(Alarm("log", row.step, "no gated figure was logged at this step: nothing was compared"))
        return WatchedStep(row.step, verdicts, tuple(alarms), dict(sorted(by_timestep.items(), reverse=True)))

    def _result(self, table: WatchTable, sources: Mapping[str, tuple[WatchedSeries, ...]]) -> WatchResult:
        steps = tuple(self._steps)
        summaries = {source: judge.summary() for source, judge in self._judges.items()}
        first = next((s for s in steps if s.alarms), None)
        return WatchResult(
            path=table.path,
            kind=table.kind,
            profile=self.settings.gate.tolerance.profile,
            steps=steps,
            summaries=summaries,
            sources={source: tuple(s.name for s in members) for source, members in sources.items()},
            ignored=dict(table.ignored),
            ended=table.ended,
            cause=None if first is None else likely_cause(steps, first, summaries),
            late_alarms=tuple(self._late),
            limits=dict(self.settings.gate.tolerance.limits),
        )


def likely_cause(steps: tuple[WatchedStep, ...], first: WatchedStep, summaries: Mapping[str, JudgeSummary]) -> str:
    """Where the gap grew at the first alarmed step, from the per-timestep series (module docstring)."""
    kinds = {a.kind for a in first.alarms}
    if kinds <= {"log"}:
        return "the log itself: " + first.alarms[0].message
    if "nonfinite" in kinds:
        return "a NaN/inf log-prob on one side (find where it turns NaN: rollout_consistency.NanCapture)"
    if not first.by_timestep:
        return "no per-timestep series was logged, so the timesteps cannot be told apart"
    floor_steps = next((set(s.floor.steps) for s in summaries.values() if s.floor is not None), None)
    reference = [s for s in steps if (s.step in floor_steps if floor_steps else s.passed) and s.step < first.step]
    growth = {}
    for t, value in first.by_timestep.items():
        levels = [s.by_timestep[t] for s in reference if t in s.by_timestep and s.by_timestep[t] > 0]
        if levels and math.isfinite(value):
            level = math.exp(math.fsum(math.log(v) for v in levels) / len(levels))
            growth[t] = (value / level, value, level)
    if not growth:
        worst = max(first.by_timestep.items(), key=lambda item: -math.inf if math.isnan(item[1]) else item[1])
        return f"no clean steps before it to compare with; the largest mean |Δlogp| is at t={timestep_label(worst[0])} ({worst[1]:.3g})"
    grown = sorted((t for t, (ratio, _, _) in growth.items() if ratio >= _GROWN), key=lambda t: -growth[t][0])
    if not grown:
        top = max(growth, key=lambda t: growth[t][0])
        return f"no timestep grew {_GROWN:g}x over its own level; the most at t={timestep_label(top)} ({growth[top][0]:.2g}x)"
    shown = ", ".join(
        f"t={timestep_label(t)} ({growth[t][1]:.3g}, {growth[t][0]:.3g}x its level {growth[t][2]:.3g})"
        for t in grown[:3]
    )
    if len(grown) == len(growth) and len(growth) > 1:
        return (
            f"every timestep grew ({shown}{', ...' if len(grown) > 3 else ''}): the model as a whole differs — "
            f"weights not synced to the rollout, another attention backend or dtype"
        )
    return (
        f"the gap grew at {len(grown)} of {len(growth)} timesteps: {shown}; the others stayed at their level — a "
        f"schedule or sigma mismatch at those timesteps (guidance and the later steps amplify the gap)"
    )


# ----------------------------------------------------------------------------------------------------
def _sources(series: tuple[WatchedSeries, ...]) -> dict[str, tuple[WatchedSeries, ...]]:
    """The series grouped by prefix, for the groups holding at least one figure that is not per timestep."""
    groups: dict[str, list[WatchedSeries]] = {}
    for one in series:
        groups.setdefault(one.prefix, []).append(one)
    return {prefix: tuple(members) for prefix, members in groups.items() if any(m.timestep is None for m in members)}


def _nothing_to_judge(table: WatchTable) -> str:
    bypass = (
        " (only bypass mode's actor/rollout_corr/*: in bypass mode old_log_probs is rollout_log_probs, so no gap "
        "is measured; run with bypass_mode=False)"
        if table.ignored
        else ""
    )
    return (
        f"{table.path} holds no rollout/trainer consistency series{bypass}: nothing to judge. verl-omni logs "
        f"rollout_corr/logprob_abs_diff_* when the rollout returns log-probs "
        f"(actor_rollout_ref.rollout.calculate_log_probs=true) and bypass mode is off; the run monitor logs "
        f"monitor/*."
    )


def _log_scale(axis: Any) -> None:
    if axis.get_lines():  # only positive values are plotted
        axis.set_yscale("log")


def _strict(value: Any) -> Any:
    """JSON-safe: NaN and ±inf become None (strict JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value
