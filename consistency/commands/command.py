# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What a sub-command is to the command line: its entry in the command table (`Command`: its name and the line
``rollout-consistency --help`` lists, read without importing its module) and, in its module, the text of its
parser (`ParserText`) next to ``add_arguments(parser)`` and ``run(args) -> int``.

`complete_parser` is the one place a command's parser is filled from its module; the command line calls it for
the command it runs only, so that a command loads what it runs (``--help`` alone loads no command).
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

__all__ = ["Command", "ParserText", "complete_parser"]


@dataclass(frozen=True)
class Command:
    """One sub-command in the table: `name` (and old `aliases`) on the command line, its `help` line in the
    top-level ``--help``, and the `module` of `rollout_consistency.commands` that holds ``PARSER_TEXT``,
    ``add_arguments(parser)`` and ``run(args) -> int``."""

    name: str
    module: str
    help: str
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class ParserText:
    """A command's ``--help`` text: `description` above the flags, `epilog` below; `raw` prints both as written
    (examples one per line), else argparse wraps them."""

    description: str
    epilog: str | None = None
    raw: bool = False


def complete_parser(parser: argparse.ArgumentParser, command: Command) -> None:
    """Give `command`'s parser (created by the table with its name and help line only) its text, its arguments
    and, as the ``run`` default, its module's ``run``: the module is imported now."""
    module = importlib.import_module(f"{__package__}.{command.module}")
    text: ParserText = module.PARSER_TEXT
    parser.description, parser.epilog = text.description, text.epilog
    if text.raw:
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)
