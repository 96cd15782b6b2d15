# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The sub-commands of `rollout-consistency`, one module each, registered in one table (`rollout_consistency.cli`).

Every command module exposes the same three names (`command`: what a command is, and the one function that
builds its parser from them)::

    PARSER_TEXT                   its ``--help`` text: description, epilog (`ParserText`)
    add_arguments(parser) -> None its flags; the module is imported only when its command runs
    run(args) -> int              0 PASS / done, 1 FAIL; bad input raises UsageError (exit 2)

`check` (the step-1 check), `gate` (a log-prob dump), `checkpointing` (old name `recompute`), `precision`,
`doctor` (a report read back), and `lint` (its command lives in the lint package, which imports nothing of the
checker; this module turns its input errors into `UsageError`). Shared by them: `usage` (`UsageError`, output paths, JSON files), `report_outputs` (the report
flags and writing of `check` and `gate`), `factories` (a user's ``SPEC`` and its ``--arg`` keywords).

A new command is one module here plus one entry in `rollout_consistency.cli.COMMANDS` (its name and the line
``rollout-consistency --help`` lists).
"""

from __future__ import annotations

from .usage import UsageError

__all__ = ["UsageError"]
