# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The report outputs `check` and `gate` share: ``--json``, ``--junit``, ``--plot``, ``--per-sample`` and
``--log``; the table is printed, the files are written all or nothing, then the figures go to each tracker."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from rollout_consistency.safeguards.atomic_write import write_all
from rollout_consistency.safeguards.cli_guard import EXIT_FAIL, EXIT_PASS
from rollout_consistency.safeguards.output_paths import OutputTarget

from .usage import UsageError

__all__ = ["add_report_outputs", "report_outputs", "show_and_write", "write_reports"]


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
    outputs.add_argument(
        "--log",
        action="append",
        default=[],
        metavar="TRACKER",
        help="also log the figures, verdict, per-timestep rows and plot to tensorboard:DIR, wandb[:PROJECT] or "
        "mlflow[:TRACKING_URI] (repeatable; each needs its extra, e.g. rollout-consistency[tensorboard])",
    )


def report_outputs(args: argparse.Namespace) -> dict[str, str | None]:
    """Output flag -> path (None where not given), for `rollout_consistency.commands.usage.check_outputs`. Also
    checks every ``--log`` tracker, so that both commands refuse an unknown one or one whose package is missing
    (`UsageError`) before any work."""
    _trackers(args)
    return {"--json": args.json, "--junit": args.junit, "--plot": args.plot}


def _trackers(args: argparse.Namespace) -> list[Any]:
    from rollout_consistency.gate.judging.loggers import LoggerError, parse_tracker

    try:
        return [parse_tracker(text) for text in args.log]
    except LoggerError as error:
        raise UsageError(f"--log: {error}") from error


def show_and_write(report: Any, args: argparse.Namespace, targets: Mapping[str, OutputTarget]) -> int:
    """Print the report's table, write the requested files to the `targets` resolved when the command started
    (`rollout_consistency.commands.usage.check_outputs`: flag -> target), and return the exit code of its
    verdict."""
    print(report.format_table(per_sample=args.per_sample))
    writers = {"--json": report.write_json, "--junit": report.write_junit, "--plot": report.write_plot}
    write_reports([(target, writers[flag]) for flag, target in targets.items()])
    _log(report, _trackers(args))
    return EXIT_PASS if report.passed else EXIT_FAIL


def write_reports(requested: list[tuple[OutputTarget, Any]]) -> None:
    """Write every ``(target, write)`` report or none (`atomic_write.write_all`: the JSON and JUnit of one run are
    renamed into place together); `UsageError` when one fails."""

    try:  # all or nothing: no report may be left that disagrees with the exit code
        written = write_all(requested)
    except OSError as error:
        raise UsageError(f"cannot write the reports ({error.strerror or error}); none was written.") from error
    for path in written:
        print(f"wrote {path}", file=sys.stderr)


def _log(report: Any, trackers: list[Any]) -> None:
    """Log to each tracker, at the checked training step (``global_step``; 0 for a dump); `UsageError` naming
    every tracker that failed, after trying them all."""
    step = report.config.get("global_step", 0)
    failed = []
    for tracker in trackers:
        try:
            report.log_to(tracker, step=step if isinstance(step, int) else 0)
        except Exception as error:  # the tracker's own errors (network, store, permissions): no report is lost
            first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
            failed.append(f"{tracker} ({first_line})")
            continue
        print(f"logged to {tracker}", file=sys.stderr)
    if failed:
        raise UsageError(f"the report was printed and written, but logging failed: {'; '.join(failed)}.")
