# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency doctor REPORT.json`: read a step-1 report written earlier and print its ranked likely
causes (the doctor itself: `rollout_consistency.gate.diagnosis.doctor`); bad input is a `UsageError`."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from rollout_consistency.gate.diagnosis.doctor import rediagnose
from rollout_consistency.gate.judging.causes import Diagnosis, format_diagnosis
from rollout_consistency.gate.judging.report import SCHEMA_NAME, SCHEMA_VERSION, Report
from rollout_consistency.safeguards.atomic_write import write_all

from .command import ParserText
from .usage import UsageError, check_outputs, check_report_file

__all__ = ["PARSER_TEXT", "add_arguments", "read_report", "run"]

#: Top-level keys every step-1 report holds (rollout_consistency.gate.judging.report's schema).
REPORT_KEYS = ("schema", "schema_version", "verdict", "tolerance", "metrics", "samples", "config", "notes", "run")


PARSER_TEXT = ParserText(
    description=(
        "Read a step-1 report (rollout-consistency check --json) and print its ranked likely causes, each "
        "with evidence and fix. The figures' signatures are re-read; a localisation or a tables' signature "
        "stored in the report is kept. Exit 0 with a diagnosis, 2 on bad input."
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("report", metavar="REPORT.json", help="a step-1 report written by check --json")
    parser.add_argument("--json", metavar="PATH", help="write the diagnosis as JSON (a list of causes)")


def read_report(path: str) -> tuple[Report, list[Diagnosis]]:
    """The step-1 report at `path` and the diagnosis stored in it; `UsageError` naming what is wrong and the fix
    for anything else (a JSON list, another schema or version, missing keys, malformed entries)."""
    write_one = "write one with `rollout-consistency check --json` (or `gate ... --json`)"
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except FileNotFoundError as error:
        raise UsageError(f"{path}: no such file; {write_one}") from error
    except IsADirectoryError as error:
        raise UsageError(f"cannot read {path}: it is a directory; pass the report file itself") from error
    except OSError as error:
        raise UsageError(f"cannot read {path}: {error.strerror or error}") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{path} is not JSON ({error}); {write_one}") from error
    if not isinstance(data, dict):
        raise UsageError(
            f"{path} holds a JSON {type(data).__name__}, not a step-1 report (a JSON object with schema "
            f"{SCHEMA_NAME!r}); {write_one}"
        )
    if data.get("schema") != SCHEMA_NAME:
        raise UsageError(
            f"{path} has schema {data.get('schema')!r}, not a step-1 report ({SCHEMA_NAME!r}); {write_one}"
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise UsageError(
            f"{path} is a step-1 report of schema_version {data.get('schema_version')!r}; this version reads "
            f"{SCHEMA_VERSION}: run the check again with this version to write one it can read"
        )
    missing = [key for key in REPORT_KEYS if key not in data]
    if missing:
        raise UsageError(
            f"{path} lacks {', '.join(missing)}: not a whole step-1 report (truncated or edited?); {write_one}"
        )
    try:
        report = Report.from_dict(data)
        stored = [Diagnosis.from_dict(d) for d in report.diagnosis]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        what = f"{type(error).__name__}: {error}" if isinstance(error, KeyError) else str(error)
        raise UsageError(f"{path} is a malformed step-1 report ({what[:200]}); {write_one}") from error
    return report, stored


def run(args: argparse.Namespace) -> int:
    """Print the diagnosis of ``args.report``; 0 when done (`UsageError` for bad input)."""
    if os.path.exists(args.report):  # a missing report is worded by read_report
        check_report_file(args.report, "REPORT.json")
    targets = check_outputs({"--json": args.json}, {"REPORT.json": args.report})
    report, stored = read_report(args.report)
    diagnoses = rediagnose(report, stored)
    print(f"rollout-consistency doctor: {args.report}: {report.status}")
    if diagnoses:
        print("\n".join(format_diagnosis(diagnoses, limit=len(diagnoses))))
    else:
        print("  nothing to diagnose: a PASS well within its limits")
    if args.json:
        text = json.dumps([d.to_dict() for d in diagnoses], indent=2, allow_nan=False) + "\n"
        try:
            write_all([(targets["--json"], lambda temporary: Path(temporary).write_text(text, encoding="utf-8"))])
        except OSError as error:
            raise UsageError(f"cannot write {args.json}: {error.strerror or error}") from error
    return 0
