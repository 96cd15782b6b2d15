# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency lint PATH...`: the command lives in `rollout_consistency.lint.cli` (the lint package
imports nothing of the checker); here its bad input becomes a `UsageError`."""

from __future__ import annotations

import argparse

from rollout_consistency.lint import LintUsageError
from rollout_consistency.lint import cli as lint_cli
from rollout_consistency.safeguards.paths import InputPathError, refuse_special

from .command import ParserText
from .usage import UsageError

__all__ = ["PARSER_TEXT", "add_arguments", "run"]

PARSER_TEXT = ParserText(description=lint_cli.DESCRIPTION, epilog=lint_cli.EPILOG, raw=True)
add_arguments = lint_cli.add_arguments


def run(args: argparse.Namespace) -> int:
    try:  # the paths named on the command line; the lint refuses what it finds inside folders itself
        for path in getattr(args, "paths", None) or ():
            refuse_special(path, "PATH")
    except InputPathError as error:
        raise UsageError(str(error)) from error
    try:
        return lint_cli.run(args)
    except LintUsageError as error:
        raise UsageError(str(error)) from error
