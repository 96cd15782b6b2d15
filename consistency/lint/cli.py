# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency lint PATH...`: the sub-command's parser and its run (exit 0 clean, 1 findings).

Bad input raises `LintUsageError`; the top-level command line turns it into exit code 2 with the message.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rollout_consistency.safeguards.atomic_write import write_all
from rollout_consistency.safeguards.output_paths import OutputPathError, check_output_paths

from .engine import FILES_PER_JOB, LintUsageError, lint_paths
from .output import FORMATS, render
from .rules import RULES

__all__ = ["DESCRIPTION", "EPILOG", "add_arguments", "run"]

EXIT_CLEAN, EXIT_FINDINGS = 0, 1


def _rule_ids(values: Sequence[str] | None) -> list[str] | None:
    """`--select a,b --select c` -> ['a', 'b', 'c']; None when the option was not given."""
    if values is None:
        return None
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


#: The `lint` command's help text: above its flags (wrapped), and below them (printed as written).
DESCRIPTION = (
    "Lint Python files and directories (searched recursively for *.py) for the anti-patterns behind known "
    "rollout/trainer disagreements. Each finding is printed as 'path:line:col rule-id message' with the "
    "fix. Suppress one on its statement with '# rollout-consistency: ignore[rule-id] reason'. "
    "Exit codes: 0 clean, 1 findings, 2 usage error (a missing or unreadable path, a directory without "
    "Python files, a FIFO or device, a bad option)."
)
EPILOG = (
    "Rules:\n"
    + "\n".join(f"  {rule.id:26} {rule.title}" for rule in RULES.values())
    + (
        "\n\nExamples:\n"
        "  rollout-consistency lint trainer/ rollout/\n"
        "  rollout-consistency lint . --exclude 'tests/*' --format github\n"
        "  rollout-consistency lint src --format sarif --output lint.sarif\n"
        "Docs: docs/lint.md"
    )
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `lint` command's arguments, added to its parser (`rollout_consistency.commands.lint`)."""
    parser.add_argument("paths", nargs="*", metavar="PATH", help="files and directories to lint")
    parser.add_argument(
        "--select", action="append", metavar="RULE[,RULE]", help="run only these rules (repeatable; default: all)"
    )
    parser.add_argument("--ignore", action="append", metavar="RULE[,RULE]", help="do not run these rules (repeatable)")
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        metavar="GLOB",
        help="skip files and directories whose path, or any component of it, matches (repeatable)",
    )
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        metavar="N",
        help=f"worker processes for a large tree, at most one per {FILES_PER_JOB} files (default: 1)",
    )
    parser.add_argument("--format", choices=FORMATS, default="text", help="report format (default: text)")
    parser.add_argument("--output", metavar="FILE", help="write the report to FILE instead of stdout")
    parser.add_argument("--list-rules", action="store_true", help="print the rules and exit")


def run(args: argparse.Namespace) -> int:
    """Run the parsed `lint` command: the report on stdout (or `--output`), a one-line summary on stderr."""
    if args.list_rules:
        for rule in RULES.values():
            print(f"{rule.id:26} {rule.title}\n{'':26} fix: {rule.fix}")
        return EXIT_CLEAN
    if not args.paths:
        raise LintUsageError("give at least one PATH (file or directory) to lint")
    try:
        # Never over a linted file: one named, or a .py file inside a linted folder.
        inputs = {f"PATH {path}": path for path in args.paths}
        targets = check_output_paths(
            {"--output": args.output}, inputs, directories_read=dict.fromkeys(inputs, (".py",))
        )
    except OutputPathError as error:
        raise LintUsageError(str(error)) from error
    findings = lint_paths(
        args.paths, select=_rule_ids(args.select), ignore=_rule_ids(args.ignore), exclude=args.exclude, jobs=args.jobs
    )
    report = render(findings, args.format)
    if args.output:
        try:
            write_all([(targets["--output"], lambda temporary: Path(temporary).write_text(report))])
        except OSError as error:
            raise LintUsageError(f"cannot write {args.output}: {error.strerror or error}") from error
    else:
        sys.stdout.write(report)
    files = len({finding.path for finding in findings})
    print(
        f"rollout-consistency lint: {len(findings)} finding{'s' * (len(findings) != 1)}"
        + (f" in {files} file{'s' * (files != 1)}" if findings else "")
        + (f"; report written to {args.output}" if args.output else ""),
        file=sys.stderr,
    )
    return EXIT_FINDINGS if findings else EXIT_CLEAN
