# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The report outputs `check` and `gate` share: ``--json``, ``--junit``, ``--plot`` and ``--per-sample``; the
table is printed, then the files are written all or nothing."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rollout_consistency.cli_guard import EXIT_FAIL, EXIT_PASS

from .usage import UsageError

__all__ = ["add_report_outputs", "report_outputs", "show_and_write"]


def add_report_outputs(parser: argparse.ArgumentParser, title: str) -> None:
    outputs = parser.add_argument_group(title)
    outputs.add_argument("--json", metavar="PATH", help="write the report as JSON")
    outputs.add_argument("--junit", metavar="PATH", help="write JUnit XML (one testcase per check) for CI")
    outputs.add_argument(
        "--plot",
        metavar="PATH",
        help="write a PNG of per-timestep signed dlogp (mean, spread, clip band, limits) and ratio",
    )
    outputs.add_argument("--per-sample", action="store_true", help="also print the per-sample table")


def report_outputs(args: argparse.Namespace) -> dict[str, str | None]:
    """Output flag -> path (None where not given)."""
    return {"--json": args.json, "--junit": args.junit, "--plot": args.plot}


def show_and_write(report: Any, args: argparse.Namespace) -> int:
    """Print the report's table, write the requested files, and return the exit code of its verdict."""
    from rollout_consistency.atomic_write import write_all

    print(report.format_table(per_sample=args.per_sample))
    writers = {"--json": report.write_json, "--junit": report.write_junit, "--plot": report.write_plot}
    requested = [(path, writers[flag]) for flag, path in report_outputs(args).items() if path]
    try:  # all or nothing: no report may be left that disagrees with the exit code
        written = write_all(requested)
    except OSError as error:
        raise UsageError(f"cannot write the reports ({error.strerror or error}); none was written.") from error
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return EXIT_PASS if report.passed else EXIT_FAIL
