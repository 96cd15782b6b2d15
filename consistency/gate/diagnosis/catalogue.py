# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The doctor's catalogue: what a confidence means, the causes' fixes, and [`make`], which builds a `Diagnosis`
(`rollout_consistency.gate.judging.causes`, the record a report carries) with its measured confidence. Each cause
is one `Cause` record in `rollout_consistency.gate.diagnosis.cause_registry` (its summary, fix, evidence kinds,
whether it is a bug); ``FIXES`` and ``NOT_A_BUG`` here derive from it.

Cause ids are stable (tests and dashboards key on them); what each means, and which evidence can name it, is its
record (docs/doctor.md's table of causes is generated from the records).

**What a confidence means.** Each diagnosis rests on one kind of evidence (`CONFIDENCE`'s keys); its
confidence is the share of the measured cases in which a diagnosis resting on that kind of evidence named the
right cause (the doctor's corpus of users' loops and the ``--inject`` pitfalls, `scripts/measure_doctor.py`).
Causes the evidence cannot separate share one kind's confidence equally: a list of ``k`` equally likely
candidates at ``c / k`` each says "one of these, the figures cannot tell which".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout_consistency.gate.judging.causes import Diagnosis

from .cause_registry import CAUSES, fixes

#: Causes that are no bug: rounding of two kernels or two batch compositions (the records' ``not_a_bug``).
NOT_A_BUG = frozenset(cause.id for cause in CAUSES.values() if cause.not_a_bug)

#: Evidence kind → the share of measured cases in which it named the right cause first (or, for shared
#: candidates, held it), as (right + 1) / (cases + 2): measured by scripts/measure_doctor.py on the doctor's
#: corpus and the --inject pitfalls (docs/doctor.md has the counts); a kind with no measured case stays at 1/2.
CONFIDENCE: Mapping[str, float] = {
    "guard": 0.86,  # a failed guard names its cause (windows, experts, schedule, NaN, missing steps, workers, weights): 5/5
    "replay-stage": 0.95,  # the first stage where both sides' own forwards part, and what differs there: 19/19
    "replay-step": 0.95,  # every forward agrees; a step setting reproduces each side's table: 18/18
    "replay-unexplained": 0.5,  # forwards agree, no candidate reproduces one side's table: not measured
    "table-ratio": 0.75,  # trainer = c · rollout: 2/2
    "table-offset": 0.67,  # one constant everywhere: 1/1
    "table-step-offset": 0.67,  # one constant per timestep: 3/4
    "table-std": 0.5,  # Δ moves with the log-prob within a timestep: not measured
    "recorded-setting": 0.8,  # a signature and a setting the report records: 3/3
    "recorded-rounding": 0.5,  # rounding-sized, the report records different kernels or batches: not measured
    "candidates": 0.85,  # a shift of the transition mean, shared by the candidates listed: 22/25 lists hold it
    "unknown": 0.25,  # nothing separates the causes: 0/2
    "near-limit": 0.3,  # a PASS near its limit (no cause claimed)
}

#: Cause id -> fix, from the cause registry (`cause_registry.CAUSES`: one `Cause` record per id, where a new cause
#: is added).
FIXES: dict[str, str] = fixes()

#: The command that separates causes the figures cannot (the end of a tables-only diagnosis's evidence).
LOCALISE_HINT = (
    "the figures cannot separate these; to localise, run the check with both sides as plug-ins exposing "
    "`model` (rollout-consistency check --rollout-backend FILE.py:make_rollout --trainer-backend "
    "FILE.py:make_trainer): the doctor replays both sides' own code and names the stage where they part"
)


def make(
    cause: str,
    summary: str,
    evidence: Sequence[str],
    kind: str,
    *,
    share: int = 1,
    source: str = "signature",
    details: Mapping[str, Any] | None = None,
) -> Diagnosis:
    """A `Diagnosis` whose confidence is evidence `kind`'s, shared by `share` equally likely candidates."""
    evidence = tuple(e for e in evidence if e)
    confidence = CONFIDENCE[kind] / max(1, share)
    entry = CAUSES[cause]
    # Once the replay has run both sides' own code, telling the user to localise would send them to run it again.
    fix = (entry.localised_fix or entry.fix) if source == "localisation" else entry.fix
    return Diagnosis(cause, summary, evidence, fix, confidence, source, details, kind)


def guard_cause(
    cause: str, summary: str, evidence: Sequence[str], *, details: Mapping[str, Any] | None = None
) -> Diagnosis:
    """A cause that a failed guard names outright: evidence kind and source ``guard``."""
    return make(cause, summary, evidence, "guard", source="guard", details=details)
