# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`gate(rollout_log_probs, trainer_log_probs, settings) -> GateReport`: gate the user's own two log-prob tables.

The tables come from the user's rollout and the user's trainer (or a dump of them, `rollout_consistency.gate.tables.dump`,
or the in-loop recorder, `rollout_consistency.gate.tables.recorder`); the metrics, tolerance profiles, verdict and
report are the step-1 checker's. What the inputs cannot support is shown as **not checked**, never as
passed: the ``workers`` guard (the tables did not come from the checker's workers) always, and the
``windows`` guard unless both ``window_starts`` and ``prompt_groups`` are given. Two tables that are one
array or tensor, or share memory (a view, ``t.numpy()`` of ``t``), FAIL the ``distinct`` guard: nothing was
compared (`rollout_consistency.gate.judging.aliasing`); equal values in two buffers are what ``exact`` asks for.

`GateReport` is a `Report` (which carries the mismatch statistics, `rollout_consistency.gate.judging.mismatch`, as every
report does) plus the guards that were not checked and the sample ids; its table, JSON (same schema, extra
keys ``not_checked``, ``sample_ids``), JUnit XML (a ``<skipped>`` testcase per guard not checked) and plot
carry all of it.
"""

from __future__ import annotations

import dataclasses
import os
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_consistency.gate.diagnosis.doctor import attach_diagnosis
from rollout_consistency.gate.judging.aliasing import ALIASED_FIX, shares_memory
from rollout_consistency.gate.judging.metrics import MetricsInputError, compute_metrics
from rollout_consistency.gate.judging.mismatch import compute_mismatch
from rollout_consistency.gate.judging.report import Report, junit_xml
from rollout_consistency.gate.judging.verdict import Problem, Verdict, decide, window_problems
from rollout_consistency.gate.judging.views import float_table, host_array

from .settings import GateInputError, TableSettings

#: Guards a pair of tables can never support: the work did not run on the checker's workers.
_NEVER_CHECKED = {"workers": "the tables come from your code, not from the checker's workers"}


@dataclass(frozen=True)
class GateReport(Report):
    """A `Report` of gated tables, with the guards that were not checked.

    Attributes:
        not_checked: guard name -> why the inputs cannot support it.
        sample_ids: the caller's id of each row (default ``0..N-1``).
    """

    not_checked: Mapping[str, str] = field(default_factory=dict)
    sample_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["not_checked"] = dict(self.not_checked)
        data["sample_ids"] = list(self.sample_ids)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GateReport:
        base = Report.from_dict(data)
        return cls(
            **{f.name: getattr(base, f.name) for f in dataclasses.fields(Report)},
            not_checked=dict(data.get("not_checked", {})),
            sample_ids=tuple(data.get("sample_ids", ())),
        )

    def format_table(self, *, per_sample: bool = False) -> str:
        lines = super().format_table(per_sample=per_sample).split("\n")
        lines[0] = lines[0].replace("step-1 check", "step-1 gate", 1)
        if self.not_checked:
            at = next((i for i, line in enumerate(lines) if line.startswith("  guards: ")), None)
            if at is not None:
                lines[at] += "  " + "  ".join(f"{name} not checked" for name in self.not_checked)
                lines[at + 1 : at + 1] = [f"    {name} not checked: {why}" for name, why in self.not_checked.items()]
        return "\n".join(lines)

    def write_junit(self, path: str | os.PathLike[str]) -> None:
        directory = os.path.dirname(os.fspath(path))
        if directory:
            os.makedirs(directory, exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(gate_junit_xml(self))


def gate(
    rollout_log_probs: Any,
    trainer_log_probs: Any,
    settings: TableSettings | None = None,
    *,
    timesteps: Any = None,
    sample_ids: Any = None,
    prompt_groups: Any = None,
    window_starts: Any = None,
    advantages: Any = None,
    **overrides: Any,
) -> GateReport:
    """Gate the user's rollout log-probs against the user's trainer's recomputation of them.

    Args:
        rollout_log_probs (`np.ndarray` or `torch.Tensor` of shape `(N, T)`, float32): the log-prob of each
            stored SDE step as the rollout computed it (``old_log_probs``), one row per sample.
        trainer_log_probs (`(N, T)` float32): the trainer's recomputation of the same steps before any update.
        settings ([`TableSettings`], *optional*): how to judge them (profile, clip ranges, micro-batch,
            threshold overrides, source and notes); default `TableSettings()`.
        timesteps (`(N, T)` float, *optional*): the timestep value of each step (per-timestep views).
        sample_ids (`(N,)` int, *optional*): your id of each row (reports name rows by it); must be unique.
        prompt_groups, window_starts (`(N,)` int, *optional*): with both, the ``windows`` guard checks that
            each prompt group shares one SDE window; otherwise it is *not checked*.
        advantages (`(N,)` float, *optional*): adds LLM verl's advantage-dependent clip fractions.
        **overrides: `TableSettings` fields by name, applied over `settings` (``gate(r, t, profile="kernel")``,
            as the pytest marker, the recorder and a dump's ``gate`` pass them).

    Returns:
        `GateReport`: PASS, or FAIL with every reason. A shape mismatch between the two tables is a FAIL
        (``shapes``), not an exception: it is what the gate is for; so are two tables that are one array or
        share memory (``distinct``: nothing was compared).

    Raises:
        GateInputError: an input cannot be used (a non-2-D or non-float table, an optional array of the wrong
            length, duplicate sample ids, non-finite timesteps or advantages, a bad setting: see `TableSettings`).
        TypeError: an override that is not a `TableSettings` field.
    """
    settings = TableSettings() if settings is None else settings
    if overrides:
        settings = settings.replace(**overrides)
    rollout = float_table(rollout_log_probs, "rollout_log_probs", GateInputError)
    trainer = float_table(trainer_log_probs, "trainer_log_probs", GateInputError)
    n = rollout.shape[0]
    ids = _vector(sample_ids, n, "sample_ids", integer=True)
    if ids is None:
        ids = np.arange(n, dtype=np.int64)
    elif np.unique(ids).size != n:
        values, counts = np.unique(ids, return_counts=True)
        raise GateInputError(
            f"sample_ids repeat {values[counts > 1][:6].tolist()}: each row must be one sample; drop the duplicates."
        )
    groups = _vector(prompt_groups, n, "prompt_groups", integer=True)
    starts = _vector(window_starts, n, "window_starts", integer=True)
    if starts is not None and (starts < 0).any():
        raise GateInputError(f"window_starts holds {int(starts.min())}; pass the first SDE step (>= 0) of each window.")
    adv = _vector(advantages, n, "advantages", integer=False)
    steps = None
    if timesteps is not None:
        steps = float_table(timesteps, "timesteps", GateInputError)
        if steps.shape != rollout.shape:
            raise GateInputError(
                f"timesteps has shape {steps.shape}, expected {rollout.shape} (one value per rollout log-prob)."
            )
        if not np.isfinite(steps).all():
            raise GateInputError("timesteps holds NaN or inf; pass the scheduler's timestep of each stored step.")
    tolerance = settings.tolerance
    low, high = settings.clip_range

    problems: list[Problem] = []
    if shares_memory(rollout_log_probs, trainer_log_probs):
        how = (
            "are one object" if rollout_log_probs is trainer_log_probs else "share memory (one is a view of the other)"
        )
        problems.append(
            Problem("distinct", f"rollout_log_probs and trainer_log_probs {how}: nothing was compared; {ALIASED_FIX}")
        )
    problems += _coverage_problems(settings.expected_samples, ids, settings.ungated_reason)
    not_checked = {**_NEVER_CHECKED, **dict(settings.not_checked or {})}
    if groups is not None and starts is not None:
        problems += [Problem("windows", m) for m in window_problems(None, starts.tolist(), groups.tolist())]
    else:
        given = "window_starts" if starts is not None else "prompt_groups" if groups is not None else None
        not_checked["windows"] = "pass both window_starts and prompt_groups" + (
            f" (only {given} given)" if given else ""
        )

    metrics = mismatch = None
    if rollout.shape != trainer.shape:
        problems.append(
            Problem(
                "shapes",
                f"rollout log-probs have shape {rollout.shape} but the trainer's have {trainer.shape}: both sides "
                f"must score the same (samples, steps)",
            )
        )
    else:
        try:
            metrics = compute_metrics(
                rollout,
                trainer,
                clip_ratio=settings.clip_ratio,
                clip_ratio_low=settings.clip_ratio_low,
                clip_ratio_high=settings.clip_ratio_high,
                micro_batch_size=settings.micro_batch_size,
                timesteps=steps,
            )
        except MetricsInputError as error:
            raise GateInputError(str(error)) from error
        mismatch = compute_mismatch(
            rollout,
            trainer,
            timesteps=steps,
            advantages=adv,
            clip_ratio_low=low,
            clip_ratio_high=high,
            clip_ratio_c=settings.clip_ratio_c,
        )
    verdict = decide(metrics, tolerance, problems)
    verdict = Verdict(tuple(c for c in verdict.checks if c.name not in not_checked))
    report = GateReport(
        verdict=verdict,
        tolerance=tolerance,
        metrics=metrics,
        notes=settings.notes,
        run={
            "mode": "gate",
            "source": settings.source,
            "settings": {
                "profile": settings.profile,
                "compute_dtype": settings.compute_dtype,
                "clip_ratio_low": float(low),
                "clip_ratio_high": float(high),
                "clip_ratio_c": float(settings.clip_ratio_c),
                "micro_batch_size": settings.micro_batch_size,
                "timesteps": steps is not None,
                "advantages": adv is not None,
            },
        },
        mismatch=mismatch,
        not_checked=not_checked,
        sample_ids=tuple(ids.tolist()),
    )
    # The doctor from the tables alone: the user's code is not at hand.
    tables = (rollout, trainer, steps) if rollout.shape == trainer.shape else None
    return attach_diagnosis(report, tables=tables)


# ----------------------------------------------------------------------------------------------------
def _coverage_problems(expected: int | tuple[int, ...] | None, ids: np.ndarray, why: str) -> list[Problem]:
    """A ``complete`` problem when the rows do not cover every sample the rollout produced."""
    if expected is None:
        return []
    if isinstance(expected, int):
        count, missing = expected, None
        absent = max(0, count - ids.size)
    else:
        wanted = set(expected)
        count, missing = len(wanted), sorted(wanted - {int(i) for i in ids})
        absent = len(missing)
    if not absent:
        return []
    which = f" (ids {missing[:6]}{' ...' if len(missing) > 6 else ''})" if missing else ""
    return [Problem("complete", f"{absent} of the {count} samples the rollout produced were not gated{which}: {why}")]


def _vector(value: Any, n: int, name: str, *, integer: bool) -> np.ndarray | None:
    if value is None:
        return None
    array = host_array(value, name, GateInputError)
    if array.shape != (n,):
        raise GateInputError(f"{name} has shape {array.shape}, expected ({n},): one value per sample (table row).")
    if integer:
        if array.dtype.kind not in "iu":
            raise GateInputError(f"{name} must hold integers, got dtype {array.dtype}.")
        return array.astype(np.int64)
    if array.dtype.kind != "f":
        array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise GateInputError(f"{name} holds NaN or inf; pass the advantage each sample was trained with.")
    return array.astype(np.float64)


def gate_junit_xml(report: GateReport) -> str:
    """The report's JUnit XML (the mismatch statistics among its ``<properties>``) plus a ``<skipped>`` testcase
    per guard not checked; the system-out is the gate's table."""
    root = ET.fromstring(junit_xml(report).split("\n", 1)[1])
    suite = root.find("testsuite")
    assert suite is not None  # junit_xml always writes one
    classname = f"rollout_consistency.step1.{report.tolerance.profile}.guard"
    for name, why in report.not_checked.items():
        case = ET.SubElement(suite, "testcase", classname=classname, name=name, time="0")
        ET.SubElement(case, "skipped", message=f"not checked: {why}")
    total = str(len(report.verdict.checks) + len(report.not_checked))
    for element in (root, suite):
        element.set("tests", total)
    suite.set("skipped", str(len(report.not_checked)))
    out = suite.find("system-out")
    if out is not None:
        suite.remove(out)
        suite.append(out)  # keep it last, after the skipped cases
        out.text = report.format_table()
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


__all__ = ["GateInputError", "GateReport", "TableSettings", "gate", "gate_junit_xml"]
