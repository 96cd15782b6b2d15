# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The in-loop recorder's coverage: which samples it recorded against those the rollout produced.

`Step1Recorder` builds it at the end of a recording (``report.run["coverage"]``) and stores it in its dump's
metadata under [`COVERAGE_KEY`], so ``gate DUMP`` judges the dump as the recorder judged the tables in process:
the same ``complete`` guard (`TableSettings.expected_samples`, or *not checked* when the rollout's sample count
is unknown) and the same notes. A dict of plain JSON values::

    recorded_samples, recorded_steps   the tables' rows and columns
    ended_by                           what ended the recording ("the first step of AdamW ...", "finish()")
    expected_samples                   how many samples the rollout produced (None: not given)
    expected_ids                       their ids when they are not 0..N-1 (None otherwise)
    not_gated                          the expected ids with no row (None without expected_samples)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .settings import TableSettings

__all__ = ["COVERAGE_KEY", "coverage_notes", "coverage_settings", "parse_coverage", "settings_with_coverage"]

#: Metadata key of the recorder's coverage in a dump (JSON).
COVERAGE_KEY = "recorder_coverage"


def parse_coverage(text: str) -> dict[str, Any]:
    """The coverage stored as `text` (a dump's metadata value).

    Raises:
        ValueError: `text` is not a coverage the recorder writes (bad JSON, a missing key, a wrong type).
    """
    try:
        coverage = json.loads(text)
        counts = [coverage["recorded_samples"], coverage["recorded_steps"]]
        expected, ids, not_gated = coverage["expected_samples"], coverage.get("expected_ids"), coverage["not_gated"]
        valid = (
            all(_count(c) for c in counts)
            and isinstance(coverage["ended_by"], str)
            and (expected is None or _count(expected))
            and all(v is None or (isinstance(v, list) and all(_count(i) for i in v)) for v in (ids, not_gated))
        )
    except (ValueError, TypeError, KeyError):
        valid = False
    if not valid:
        raise ValueError(f"{text[:80]!r} is not the recorder's coverage")
    return coverage


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def coverage_settings(coverage: Mapping[str, Any]) -> dict[str, Any]:
    """`TableSettings` fields for a coverage: ``expected_samples`` when known, else ``complete`` not checked."""
    if coverage.get("expected_samples") is None:
        return {
            "not_checked": {
                "complete": "the recorder does not know how many samples the rollout produced; pass "
                "expected_samples=N to check that every sample was gated"
            }
        }
    ids = coverage.get("expected_ids")
    return {
        "expected_samples": tuple(ids if ids is not None else range(coverage["expected_samples"])),
        "ungated_reason": "not scored before the first optimizer update (scored later, they come from updated "
        "weights and cannot be step-1 gated): score the whole rollout batch before the first real update "
        "(gradient accumulation), or set expected_samples to the samples of the first update",
    }


def coverage_notes(coverage: Mapping[str, Any]) -> list[str]:
    """The report's notes on what a recorder recorded."""
    line = (
        f"recorded {coverage['recorded_samples']} samples x {coverage['recorded_steps']} steps, until "
        f"{coverage['ended_by']}"
    )
    if coverage.get("expected_samples") is None:
        return [line + "; the rollout's sample count is unknown (expected_samples not given)"]
    missing = coverage.get("not_gated") or []
    if not missing:
        return [line + f"; all {coverage['expected_samples']} expected samples gated"]
    return [line + f"; {len(missing)} of {coverage['expected_samples']} expected samples not gated: {missing[:6]}"]


def settings_with_coverage(
    coverage: Mapping[str, Any], settings: TableSettings | None, overrides: Mapping[str, Any]
) -> TableSettings:
    """The `TableSettings` judging a recorder's tables (in process, or from its dump): `settings` with the
    coverage's fields (`coverage_settings`), then the caller's `overrides`, and the coverage's notes appended."""
    judged = (settings or TableSettings()).replace(**{**coverage_settings(coverage), **overrides})
    return judged.replace(notes=(*judged.notes, *coverage_notes(coverage)))
