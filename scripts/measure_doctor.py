#!/usr/bin/env python
# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Measure the doctor: how often it names the right cause first, on code we did not write and on our own.

    .venv/bin/python scripts/measure_doctor.py            # corpus + own-code sets, markdown tables (~2-4 min on 2 cores)
    .venv/bin/python scripts/measure_doctor.py --quick    # the corpus only

* **Corpus** (tests/doctor_corpus): users' own plug-in loops in the shape of flow_grpo, verl-omni and DanceGRPO,
  one bug on one side each. *Localised*: the check with both plug-ins (the doctor replays both sides' own code).
  *Figures only*: the same loops' tables through ``gate()``. A cause counts as first only when no other cause
  shares its confidence; a list of equally likely candidates that holds the right cause is counted apart.
* **Own code**: the ``--inject`` pitfalls, from their figures alone (tests/doctor_reports) and end to end through
  the check.
* **Calibration**: for every first cause, its confidence against whether it was right (docs/doctor.md, "What a
  confidence means").

Also counted, the issue's guarantees: FAILs without a diagnosis, and "not a bug" causes named by the figures for a
difference whose source the report does not record. Uses only ``run_step1_check``, ``gate`` and the doctor's
``diagnose``, so the same script measures an older doctor too (one from before the gate's subpackages holds
``diagnose`` in its ``doctor`` module: change that one import).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

NOT_A_BUG = {"attention-kernel", "batch-composition"}


def first(causes):
    """The cause ranked first alone (None when another shares its confidence)."""
    if not causes:
        return None
    if len(causes) > 1 and causes[1][1] >= causes[0][1]:
        return None
    return causes[0][0]


def tied(causes):
    """The causes that share the top confidence."""
    return {c for c, v in causes if causes and v >= causes[0][1]}


def _kind(top, causes) -> str:
    """The evidence kind of the first cause (an older doctor without kinds: its confidence)."""
    return top.get("kind") or f"confidence {causes[0][1]:.3g}"


def corpus(calibration):
    from doctor_corpus.run import case_files, run_case

    rows, totals = [], defaultdict(int)
    for path in case_files():
        outcome = run_case(path)
        row = {"case": outcome.name, "expected": outcome.expected, "status": outcome.status}
        for label, causes in (("localised", outcome.localised), ("figures", outcome.figures)):
            top = first(causes)
            row[label] = top or ("tie: " + "/".join(sorted(tied(causes))) if causes else "none")
            if label == "figures" and outcome.figures_report is None:
                row[label] = "n/a (the trainer scored nothing: no table for gate())"
                continue
            if outcome.status != "FAIL":
                continue
            totals[f"{label}.fails"] += 1
            totals[f"{label}.right"] += top == outcome.expected
            totals[f"{label}.among"] += top is None and outcome.expected in tied(causes)
            totals[f"{label}.empty"] += not causes
            if label == "figures":
                # No plug-in report records a kernel or batch difference between the sides.
                totals["figures.noise"] += bool(NOT_A_BUG & {c for c, _ in causes})
            report = outcome.localised_report if label == "localised" else outcome.figures_report
            if causes:
                calibration[_kind(report.diagnosis[0], causes)].append(outcome.expected in tied(causes))
        rows.append(row)
        print(
            f"  {outcome.name}: {outcome.status}, localised {row['localised']}, figures {row['figures']}",
            file=sys.stderr,
        )
    return rows, totals


def own_code(calibration):
    from rollout_consistency import Report, run_step1_check
    from rollout_consistency.adapters import INJECTION_NAMES
    from rollout_consistency.gate import diagnose

    reports = ROOT / "tests" / "doctor_reports"
    figures = localised = fails_empty = 0
    for name in INJECTION_NAMES:
        causes = [(d.cause, d.confidence) for d in diagnose(Report.from_json((reports / f"{name}.json").read_text()))]
        figures += first(causes) == name
        top = diagnose(Report.from_json((reports / f"{name}.json").read_text()))[0].to_dict()
        calibration[_kind(top, causes)].append(name in tied(causes))
        report = run_step1_check(inject=name, progress=False)
        checked = [(d["cause"], float(d["confidence"])) for d in report.diagnosis]
        fails_empty += not report.passed and not checked
        localised += first(checked) == name
        if checked:
            calibration[_kind(report.diagnosis[0], checked)].append(name in tied(checked))
        print(f"  --inject {name}: figures {first(causes)}, check {first(checked)}", file=sys.stderr)
    return len(INJECTION_NAMES), figures, localised, fails_empty


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the corpus only")
    args = parser.parse_args(argv)
    calibration = defaultdict(list)
    rows, t = corpus(calibration)
    print("| case | expected | check | localised first | figures-only first |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['case']} | `{row['expected']}` | {row['status']} | {row['localised']} | {row['figures']} |")
    print()
    for label in ("localised", "figures"):
        n = t[f"{label}.fails"]
        print(
            f"{label}: right cause first {t[f'{label}.right']}/{n} ({t[f'{label}.right'] / max(n, 1):.0%}); right cause "
            f"among equally likely candidates {t[f'{label}.among']}/{n}; FAILs without a diagnosis {t[f'{label}.empty']}"
        )
    print(f"figures only: 'not a bug' named with no recorded source: {t['figures.noise']}")
    if not args.quick:
        n, figures, localised, empty = own_code(calibration)
        print(
            f"--inject pitfalls: right cause first from the figures {figures}/{n}, through the check {localised}/{n}; "
            f"FAILs without a diagnosis {empty}"
        )
    print()
    declared = _declared()
    print(
        "| evidence kind of the first cause | cases | right (or among the tied) | (right + 1) / (cases + 2) | declared |"
    )
    print("|---|---|---|---|---|")
    for kind, hits in sorted(calibration.items(), key=lambda item: -len(item[1])):
        estimate = (sum(hits) + 1) / (len(hits) + 2)
        print(f"| {kind} | {len(hits)} | {sum(hits)} | {estimate:.2f} | {declared.get(kind, '-')} |")
    return 0


def _declared() -> dict:
    try:
        from rollout_consistency.gate.diagnosis.catalogue import CONFIDENCE
    except ImportError:  # an older doctor
        return {}
    return dict(CONFIDENCE)


if __name__ == "__main__":
    sys.exit(main())
