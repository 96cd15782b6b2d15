# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Command line: `rollout-consistency <command>` (also `python -m rollout_consistency <command>`).

Exit codes for every command: 0 pass, 1 fail, 2 could not run (bad arguments, unloadable spec or file, resource
limit, unreachable cluster), 130 interrupted; never a traceback (`--debug` shows it; see `cli_guard`).

Each command is a module of `rollout_consistency.commands` with its parser's text (`PARSER_TEXT`),
`add_arguments(parser)` and `run(args) -> int`, listed in `COMMANDS` with the line `--help` shows. A command's
module is imported when the command line names it (`commands.command.complete_parser`), so a command loads what it
runs: `--help` loads no command, `lint` only the lint, `check` its settings (the gate's sides when it runs).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence
from typing import Any

# Cheap to import (no numpy, no torch): a command's module is imported only when that command runs.
from rollout_consistency import __version__
from rollout_consistency.commands.command import Command, complete_parser
from rollout_consistency.commands.usage import UsageError
from rollout_consistency.safeguards.cli_guard import EXIT_USAGE, guarded
from rollout_consistency.safeguards.supervisor import exit_now, run_supervised

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

#: The sub-commands, in `--help` order (the step-1 `check` first): the name and help line `--help` lists, and the
#: module of `rollout_consistency.commands` that builds the command's parser and runs it (`Command`).
COMMANDS = (
    Command("check", "check", "step-1 check: rollout log-probs vs the trainer's recomputation (ratio must be 1)"),
    Command("gate", "gate", "gate a dump of your own rollout and trainer log-prob tables (ratio must be 1 at step 1)"),
    Command(
        "watch",
        "watch",
        "judge every step of a run from its logged series (TensorBoard, wandb offline, MLflow file store)",
    ),
    Command(
        "checkpointing",
        "checkpointing",
        "check that gradient checkpointing recomputes the same forward (same loss and gradients)",
        # The old name keeps users' CI scripts working; it prints a deprecation note.
        aliases=("recompute",),
    ),
    Command(
        "precision",
        "precision",
        "audit precision settings (TF32, autocast, GradScaler, determinism) or diff two audits",
    ),
    Command("lint", "lint", "find the known rollout/trainer disagreement anti-patterns in Python source (static, AST)"),
    Command(
        "doctor", "doctor", "name the likely causes of a step-1 report's FAIL (a report written earlier with --json)"
    ),
    Command(
        "plugin-template",
        "plugin_template",
        "write a working flow_grpo-style rollout/trainer plug-in pair to start from",
    ),
)

PROG = "rollout-consistency"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 pass, 1 fail, 2 could not run, 130 interrupted).

    Without `argv` — the process entry: the console script, ``python -m rollout_consistency`` — the command runs
    in a supervised child process (`rollout_consistency.safeguards.supervisor`), so no user code can turn the run into exit
    0 without a verdict, and the process exits with the code (this call does not return). Called so from a
    process that runs other threads or has imported torch, which cannot be forked safely, it runs
    ``python -m rollout_consistency`` with ``sys.argv[1:]`` in a fresh interpreter instead (supervised there). With
    `argv` (tests, a Python launcher) it runs in this process, fenced but unsupervised, and returns the code.
    """

    if argv is None:  # the process entry: the process ends here, with the code the child handed over
        respawn = [sys.executable, "-m", "rollout_consistency", *sys.argv[1:]] if sys.executable else None
        exit_now(run_supervised(main, sys.argv[1:], PROG, respawn=respawn))
    return guarded(_main, argv, PROG)


def _main(argv: Sequence[str]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: 0 after --help, 2 on bad arguments
        return int(exit_.code or 0)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return args.run(args)
    except UsageError as error:
        # Parser messages wrap: one line. An indented block after a blank line is an example, shown as is.
        message, _, example = str(error).partition("\n\n")
        one_line = " ".join(line.strip() for line in message.splitlines() if line.strip())
        print(f"{PROG} {args.command}: error: {one_line}" + (f"\n{example}" if example else ""), file=sys.stderr)
        return EXIT_USAGE


class _Parser(argparse.ArgumentParser):
    """argparse, plus the closest known flag for a misspelt one (as config keys get)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            known = sorted(_option_strings(self))
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0]
                if flag.startswith("--"):
                    close = difflib.get_close_matches(flag, known, n=1)
                    if close:
                        message += f" (did you mean {close[0]}?)"
        super().error(message)


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    options = set()
    for action in parser._actions:
        options.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                options |= _option_strings(subparser)
    return options


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every command's sub-parser named, each filled in from its module the first time a
    command line names it (so building it imports no command)."""
    parser = _Parser(
        prog=PROG,
        description="Consistency checks for diffusion RL training (rollout vs trainer, and within a training run).",
        epilog="Exit codes: 0 pass, 1 fail, 2 could not run, 130 interrupted. Docs: docs/training-consistency.md",
    )
    parser.add_argument("--version", action="version", version=f"rollout-consistency {__version__}")
    # Stripped from the command line before parsing (`cli_guard.split_debug`), so any command takes it.
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (any command)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", action=_Commands)
    for command in COMMANDS:
        subparsers.add_parser(command.name, help=command.help, aliases=command.aliases)
    return parser


class _Commands(argparse._SubParsersAction):
    """The sub-parsers, each created with its name and help line only: the chosen command's parser is completed
    (`complete_parser`: its module imported, its arguments added) when the command line names it."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        name = values[0]  # argparse has checked it is a command's name or alias
        chosen = self.choices[name]
        if chosen.get_default("run") is None:  # once per parser, however often it parses
            complete_parser(chosen, next(c for c in COMMANDS if name == c.name or name in c.aliases))
        super().__call__(parser, namespace, values, option_string)
