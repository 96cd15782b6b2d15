# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A likely cause as a report carries it: [`Diagnosis`] (its JSON form is the report's ``diagnosis`` entry) and
[`format_diagnosis`], the lines the terminal table prints.

The doctor (`rollout_consistency.gate.diagnosis.doctor`) finds and ranks the causes; the report only stores and
renders them, so this record sits below both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Diagnosis", "format_diagnosis"]


@dataclass(frozen=True)
class Diagnosis:
    """One likely cause.

    Attributes:
        cause: stable id (listed in `rollout_consistency.gate.diagnosis.catalogue`). summary: one sentence
            naming the cause. evidence: what the report records or the replay measured that points at it.
            fix: what to change.
        confidence: 0..1, the ranking key (what it means: `rollout_consistency.gate.diagnosis.catalogue`).
            source: ``"guard"``, ``"localisation"``, ``"tables"`` or ``"signature"``.
        details: optional machine-readable extras (the localisation's stage table, the tables' signature).
        kind: the kind of evidence the confidence is measured for (a key of the catalogue's ``CONFIDENCE``).
    """

    cause: str
    summary: str
    evidence: tuple[str, ...]
    fix: str
    confidence: float
    source: str = "signature"
    details: Mapping[str, Any] | None = None
    kind: str = ""

    def to_dict(self) -> dict[str, Any]:
        out = {
            "cause": self.cause,
            "summary": self.summary,
            "evidence": list(self.evidence),
            "fix": self.fix,
            "confidence": round(self.confidence, 3),
            "source": self.source,
        }
        if self.kind:
            out["kind"] = self.kind
        if self.details is not None:
            out["details"] = dict(self.details)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Diagnosis:
        return cls(
            cause=str(data["cause"]),
            summary=str(data["summary"]),
            evidence=tuple(str(e) for e in data.get("evidence", ())),
            fix=str(data["fix"]),
            confidence=float(data.get("confidence", 0.5)),
            source=str(data.get("source", "signature")),
            details=data.get("details"),
            kind=str(data.get("kind", "")),
        )

    def headline(self) -> str:
        """One line: the cause and its fix (the JUnit failure's first line)."""
        return f"likely cause [{self.cause}]: {self.summary} Fix: {self.fix}"


def format_diagnosis(diagnoses: Sequence[Mapping[str, Any] | Diagnosis], *, limit: int = 3) -> list[str]:
    """Lines for the terminal: the top `limit` causes with their evidence and fix."""
    items = [d if isinstance(d, Diagnosis) else Diagnosis.from_dict(d) for d in diagnoses]
    if not items:
        return []
    lines = ["  doctor: likely causes, most likely first"]
    for rank, d in enumerate(items[:limit], start=1):
        lines.append(f"   {rank}. [{d.cause}] {d.summary} ({d.source}, confidence {d.confidence:.2f})")
        lines.extend(f"      evidence: {e}" for e in d.evidence)
        lines.append(f"      fix: {d.fix}")
    if len(items) > limit:
        lines.append(f"   ({len(items) - limit} less likely: {', '.join(d.cause for d in items[limit:])})")
    return lines
