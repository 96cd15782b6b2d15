# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency plugin-template [PATH]`: a working flow_grpo-style rollout/trainer plug-in pair to start
from (the file `rollout_consistency.plugin_template`), printed or written to a new file."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rollout_consistency.cli_guard import EXIT_PASS

from .usage import UsageError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plugin-template",
        help="write a working flow_grpo-style rollout/trainer plug-in pair to start from",
        description=(
            "Write a plug-in file holding a flow_grpo-style rollout (pipeline_with_logprob) and trainer "
            "(compute_log_prob) that passes the step-1 check on the built-in tiny model as written; replace the "
            "parts marked YOUR CODE with yours. Without PATH it is printed."
        ),
        epilog="Then: rollout-consistency check --rollout-backend PATH:make_rollout --trainer-backend "
        "PATH:make_trainer --sde-window-size all. Docs: docs/checker.md",
    )
    parser.add_argument("path", metavar="PATH", nargs="?", help="the .py file to write (never overwritten)")
    return parser


def run(args: argparse.Namespace) -> int:
    from rollout_consistency import plugin_template

    text = Path(plugin_template.__file__).read_text(encoding="utf-8")
    if args.path is None:
        print(text, end="")
        return EXIT_PASS
    if not args.path.endswith(".py"):
        raise UsageError(f"PATH {args.path} must end in .py: the checker imports it as a Python file.")
    if os.path.lexists(args.path):
        raise UsageError(f"PATH {args.path} exists; name a new file (the template never overwrites one).")
    _write_text_exclusive(args.path, text)
    print(
        f"wrote {args.path}; run it with:\n  rollout-consistency check --rollout-backend {args.path}:make_rollout "
        f"--trainer-backend {args.path}:make_trainer --sde-window-size all",
        file=sys.stderr,
    )
    return EXIT_PASS


def _write_text_exclusive(path: str, text: str) -> None:
    try:
        with open(path, "x", encoding="utf-8") as handle:  # "x": a file created meanwhile is not overwritten
            handle.write(text)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from error
