# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The doctor: a ranked list of likely causes, each with its evidence and its fix, for every FAIL (and for a
PASS close to its limits).

Three sources of evidence, strongest first:

* **guards** that failed (windows, experts, NaN/Inf, missing steps, dead workers, a mixed-dtype batch);
* **localisation**: both sides' own code replayed on the batch that holds the worst sample, their models
  watched, their forwards compared call by call for the same (sample, step)
  (`rollout_consistency.gate.diagnosis.replay`, `rollout_consistency.gate.diagnosis.localise`); the first stage
  where they part names the cause, and when every forward agrees, the step setting that reproduces each side's
  log-probs does (`rollout_consistency.gate.diagnosis.step_fit`);
* **figures**: the two tables' signature where the doctor runs beside them (`gate()`, the check), the report's
  metrics and the settings it records (`rollout_consistency.gate.diagnosis.figure_causes`).

Every FAIL gets a diagnosis; where the evidence cannot separate causes, the candidates share one confidence
and the evidence names the command that separates them. Cause ids, fixes and what a confidence means:
`rollout_consistency.gate.diagnosis.catalogue`; the record a report carries, `Diagnosis`:
`rollout_consistency.gate.judging.causes`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from rollout_consistency.gate.judging.causes import Diagnosis
from rollout_consistency.gate.judging.tolerances import deviation
from rollout_consistency.gate.judging.verdict import PER_REQUEST_WINDOW_MARKS, PLAN_WINDOW_MARK

from .catalogue import LOCALISE_HINT, guard_cause, make
from .figure_causes import from_figures
from .localised_causes import from_localisation
from .schedule_guard import from_schedule_guard
from .settings import DiagnosisSettings

__all__ = [
    "NEAR_LIMIT_FRACTION",
    "attach_diagnosis",
    "diagnose",
    "diagnose_check",
    "needs_diagnosis",
    "rediagnose",
]

#: A PASS whose worst figure reaches this fraction of its limit gets a diagnosis too.
NEAR_LIMIT_FRACTION = 0.5


# ----------------------------------------------------------------------------------------------------
def needs_diagnosis(report: Any) -> bool:
    """A FAIL, or a PASS whose worst gated figure reaches `NEAR_LIMIT_FRACTION` of its limit."""
    return not report.passed or _near_limit(report) is not None


def diagnose(
    report: Any, localisation: Any = None, *, tables: Any = None, not_localised: str | None = None
) -> tuple[Diagnosis, ...]:
    """Ranked likely causes of `report`'s disagreement (empty for a clean PASS; never empty for a FAIL).

    Args:
        report: a `rollout_consistency.gate.judging.report.Report` (a `gate()` report too).
        localisation: a `rollout_consistency.gate.diagnosis.localise.Localisation` of the same setup, if one ran.
        tables: ``(rollout, trainer[, timesteps])`` log-prob tables the report's figures come from, if at hand.
        not_localised: why no localisation ran (said in the evidence of the figures' causes).
    """
    if not needs_diagnosis(report):
        return ()
    config = dict(report.config or {})
    found: list[Diagnosis] = _from_guards(report)
    if localisation is not None:
        found.append(from_localisation(localisation, config))
    signature = _signature(tables)
    figures = from_figures(report, config, signature)
    if localisation is not None:  # the replay ran: the figures' pointer to it is moot
        figures = [dataclasses.replace(d, evidence=tuple(e for e in d.evidence if e != LOCALISE_HINT)) for d in figures]
    if not_localised and figures:
        figures = [dataclasses.replace(d, evidence=(*d.evidence, f"not localised: {not_localised}")) for d in figures]
    found += figures
    near = _near_limit(report)
    if report.passed and near is not None:
        found.append(near)
    if not report.passed and not found:
        found.append(_undetermined(report, not_localised))
    return _rank(found)


def attach_diagnosis(report: Any, localisation: Any = None, **options: Any) -> Any:
    """`report` with its ``diagnosis`` filled (a copy; the report is frozen). `options`: see [`diagnose`]."""
    causes = diagnose(report, localisation, **options)
    return dataclasses.replace(report, diagnosis=tuple(d.to_dict() for d in causes))


def diagnose_check(report: Any, settings: DiagnosisSettings, plan: Sequence[Any], results: Sequence[Any] = ()) -> Any:
    """The check's hook: diagnose a FAIL (or near-limit PASS), localising it by replaying both sides' own code
    on the batch that holds the worst sample (`rollout_consistency.gate.diagnosis.localise.localise_check`).

    Args:
        results: the check's `BatchResult`s (their tables feed the figures and check the replay's faithfulness).
    """
    if not needs_diagnosis(report):
        return report
    tables = _stack(results)
    localisation, why = None, None
    metrics = report.metrics
    if "experts" in _failed(report):  # both sides' records already say which network scored each step
        why = "the experts guard records which expert each side scored every step with"
    elif metrics is not None and metrics.overall.count and metrics.overall.max_abs_dlogp > 0:
        worst = max(metrics.by_sample, key=lambda s: _finite(s.values.max_abs_dlogp)).index
        batch = next((b for b in plan if worst in b.sample_indices), None)
        if batch is not None:
            from .localise import localise_check

            found = localise_check(settings, batch, _batch_tables(results, batch.index))
            if isinstance(found, str):
                why = found
            else:
                localisation = found
    return attach_diagnosis(report, localisation, tables=tables, not_localised=why)


# ----------------------------------------------------------------------------------------------------
def _rank(found: list[Diagnosis]) -> tuple[Diagnosis, ...]:
    """Highest confidence first (ties keep their order); one entry per cause (its best, others' evidence appended)."""
    best: dict[str, Diagnosis] = {}
    for d in sorted(found, key=lambda d: -d.confidence):
        if d.cause not in best:
            best[d.cause] = d
        else:
            kept = best[d.cause]
            extra = tuple(e for e in d.evidence if e not in kept.evidence)
            details = kept.details if kept.details is not None else d.details
            best[d.cause] = dataclasses.replace(kept, evidence=kept.evidence + extra, details=details)
    return tuple(sorted(best.values(), key=lambda d: -d.confidence))


def _finite(value: float) -> float:
    return value if math.isfinite(value) else math.inf


def _signature(tables: Any) -> dict[str, Any] | None:
    if tables is None:
        return None
    from .table_signatures import read_tables

    rollout, trainer, *rest = tables
    signature = read_tables(rollout, trainer, rest[0] if rest else None)
    return None if signature.get("kind") in (None, "none") else signature


def _stack(results: Sequence[Any]) -> tuple[Any, Any, Any] | None:
    import numpy as np

    parts = [r for r in results if r is not None and not r.problems]
    if not parts or len({r.rollout_log_probs.shape[1] for r in parts}) != 1:
        return None
    return tuple(
        np.concatenate([getattr(r, name) for r in parts])
        for name in ("rollout_log_probs", "trainer_log_probs", "timesteps")
    )


def _batch_tables(results: Sequence[Any], index: int) -> tuple[Any, Any] | None:
    result = next((r for r in results if r is not None and r.batch == index and not r.problems), None)
    return None if result is None else (result.rollout_log_probs, result.trainer_log_probs)


def _failed(report: Any) -> dict[str, Any]:
    return {c.name: c for c in report.verdict.checks if not c.passed}


def _evidence_text(message: str, limit: int = 300) -> str:
    """`message` whole when it is short; else its leading sentences within `limit` characters, cut where a
    sentence or clause ends (never inside a word or a name), pointing at the whole message."""
    if len(message) <= limit:
        return message
    head = message[:limit]
    for end in (". ", "; ", ", ", " "):
        cut = head.rfind(end)
        if cut > 0:
            return head[: cut + len(end.rstrip())] + " … (the whole message is under FAIL because)"
    return head + " … (the whole message is under FAIL because)"


def _from_guards(report: Any) -> list[Diagnosis]:
    failed = _failed(report)
    out = []
    if "distinct" in failed:
        out.append(
            guard_cause(
                "aliased-tables",
                "The two log-prob tables are one buffer, or the trainer wrote into the rollout's: nothing was "
                "compared.",
                [f"distinct guard: {_evidence_text(failed['distinct'].message)}"],
            )
        )
    windows = failed["windows"].message if "windows" in failed else ""
    per_request = [windows.index(mark) for mark in PER_REQUEST_WINDOW_MARKS if mark in windows]
    # Windows drawn per request are not the plan's either: that reason is their consequence, not a second cause.
    if PLAN_WINDOW_MARK in windows and not per_request:
        out.append(
            guard_cause(
                "window-plan",
                "A side sampled or scored other steps than the plan's SDE window (another width or schedule).",
                [f"windows guard: {_evidence_text(windows[windows.index(PLAN_WINDOW_MARK) :])}"],
            )
        )
    if per_request:
        reason = windows.rfind("; ", 0, min(per_request))  # its own reason, after any other of the guard's
        out.append(
            guard_cause(
                "per-request-window",
                "The SDE window is drawn per request, not per prompt group from the launcher's seed.",
                [f"windows guard: {_evidence_text(windows[0 if reason < 0 else reason + 2 :])}"],
            )
        )
    rollout = failed.get("rollout")
    if rollout is not None and "Mixed dtypes" in rollout.message:
        out.append(
            guard_cause(
                "stepwise-bf16",
                "The step-wise engine keeps per-request latents in the model's low precision; a fresh float32 "
                "request cannot join them.",
                [f"rollout failed: {_evidence_text(rollout.message)}"],
            )
        )
    elif rollout is not None:
        out.append(
            guard_cause(
                "worker-failure",
                "The rollout engine failed on a batch: those samples were never compared.",
                [f"rollout failed: {_evidence_text(rollout.message)}"],
            )
        )
    if "experts" in failed:  # both sides' records say which network scored each step: no guessing
        out.append(
            guard_cause(
                "expert-switch",
                "The rollout and the trainer scored some steps with different experts (Wan 2.2's transformer / "
                "transformer_2): one side switches at another step, or holds one expert throughout.",
                [f"experts guard: {_evidence_text(failed['experts'].message, 600)}"],
            )
        )
    if "schedule" in failed:  # the trainer's scheduler cannot look up what the rollout stored: it scored nothing
        steps = report.metrics.by_timestep if report.metrics is not None else ()
        stored = [step.timestep for step in steps if step.timestep is not None]
        unscorable = from_schedule_guard(failed["schedule"].message, dict(report.config or {}), stored)
        out += [] if unscorable is None else [unscorable]
    if "finite" in failed and _nonfinite_log_probs(report) and not _unscored_only(report, failed):
        out.append(
            guard_cause(
                "nonfinite",
                "A log-prob is NaN or Inf.",
                [_evidence_text(failed["finite"].message)],
            )
        )
    for name in ("complete", "shapes", "nonempty"):
        if name in failed and not (name == "nonempty" and rollout is not None):
            out.append(
                guard_cause(
                    "incomplete",
                    "The two sides did not score the same (samples, window steps).",
                    [f"{name} guard: {_evidence_text(failed[name].message)}"],
                )
            )
            break
    if "workers" in failed:
        out.append(
            guard_cause(
                "worker-failure",
                "A worker died or failed.",
                [_evidence_text(failed["workers"].message)],
            )
        )
    if "calibration" in failed:
        out.append(
            guard_cause(
                "calibration",
                "The calibration floor could not be measured.",
                [f"calibration guard: {_evidence_text(failed['calibration'].message)}"],
            )
        )
    if "weights" in failed:
        out.append(
            guard_cause(
                "different-weights",
                "The two sides' weights differ.",
                [f"weights guard: {_evidence_text(failed['weights'].message)}"],
            )
        )
    return out


def _nonfinite_log_probs(report: Any) -> bool:
    """NaN/Inf in a log-prob itself (not a ratio exp(Δlogp) that overflowed from finite log-probs)."""
    metrics = report.metrics
    return metrics is None or bool(metrics.nonfinite) or not math.isfinite(metrics.overall.max_abs_dlogp)


def _unscored_only(report: Any, failed: dict[str, Any]) -> bool:
    """Every non-finite log-prob is the trainer's, in a batch it scored nothing of (the ``schedule`` guard's NaN)."""
    entries = report.metrics.nonfinite if report.metrics is not None else ()
    return "schedule" in failed and bool(entries) and all(e.side == "trainer" for e in entries)


def _undetermined(report: Any, not_localised: str | None) -> Diagnosis:
    reasons = _evidence_text("; ".join(report.reasons[:2]))
    evidence = [f"the check failed: {reasons}" if reasons else "the check failed", LOCALISE_HINT]
    if not_localised:
        evidence.append(f"not localised: {not_localised}")
    return make(
        "different-computation",
        "The sides disagree and nothing recorded or measured says where.",
        evidence,
        "unknown",
    )


def _near_limit(report: Any) -> Diagnosis | None:
    m = report.metrics
    if m is None or not report.passed:
        return None
    worst = None
    for metric, limit in report.tolerance.limits.items():
        if not limit:
            continue
        fraction = deviation(metric, m.overall.get(metric)) / limit
        if fraction >= NEAR_LIMIT_FRACTION and (worst is None or fraction > worst[1]):
            worst = (metric, fraction, limit)
    if worst is None:
        return None
    metric, fraction, limit = worst
    return make(
        "near-limit",
        f"PASS, but {metric} is at {fraction:.0%} of its limit.",
        [f"{metric} = {m.overall.get(metric):.3g}, {report.tolerance.profile} limit {limit:.3g}"],
        "near-limit",
    )


# ----------------------------------------------------------------------------------------------------
def rediagnose(report: Any, stored: Sequence[Diagnosis]) -> tuple[Diagnosis, ...]:
    """The diagnosis of a report read back (`rollout-consistency doctor`, rollout_consistency.commands.doctor):
    derived again from the report, with what cannot be (a replay, the tables' signature) kept as `stored`."""
    kept = [d for d in stored if d.source in ("localisation", "tables")]
    return _rank([*kept, *diagnose(report)]) if needs_diagnosis(report) else ()
