# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""`rollout-consistency plugin-template [PATH]`: a working flow_grpo-style rollout/trainer plug-in pair to start
from (the file `rollout_consistency.plugin_template`), printed or written to a new file."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES
from rollout_consistency.safeguards.cli_guard import EXIT_PASS

from .command import ParserText
from .usage import UsageError

__all__ = ["PARSER_TEXT", "add_arguments", "run", "template_text"]


PARSER_TEXT = ParserText(
    description=(
        "Write a plug-in file holding a flow_grpo-style rollout (pipeline_with_logprob) and trainer "
        "(compute_log_prob) that passes the step-1 check on the built-in tiny model as written; replace the "
        "parts marked YOUR CODE with yours. Without PATH it is printed."
    ),
    epilog=(
        "Then: rollout-consistency check --rollout-backend PATH:make_rollout --trainer-backend "
        "PATH:make_trainer --sde-window-size all --model-family FAMILY. Docs: docs/checker.md"
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", nargs="?", help="the .py file to write (never overwritten)")
    parser.add_argument(
        "--family",
        choices=BUILTIN_FAMILIES.names(),
        default="qwen-image",
        help="the model family the pair samples and scores, on its built-in tiny model (default: qwen-image; wan "
        "also reports Wan 2.2's experts)",
    )


def template_text(family: str) -> str:
    """The template's source with `family` as its ``FAMILY`` (and in the run command its docstring shows)."""
    # Read, not imported: the template imports torch and diffusers, which printing it does not need.
    spec = importlib.util.find_spec("rollout_consistency.plugin_template")
    text = Path(spec.origin).read_text(encoding="utf-8")
    for written in _FAMILY_TEXT:
        if text.count(written) != 1:  # pragma: no cover - the template and this command change together
            raise AssertionError(f"the plug-in template must hold {written!r} once")
        text = text.replace(written, written.replace("qwen-image", family))
    return text


# What `--family` rewrites in the template: its FAMILY and the run command in its docstring.
_FAMILY_TEXT = ('FAMILY = "qwen-image"', "--model-family qwen-image")


def run(args: argparse.Namespace) -> int:
    text = template_text(args.family)
    if args.path is None:
        print(text, end="")
        return EXIT_PASS
    if not args.path.endswith(".py"):
        raise UsageError(f"PATH {args.path} must end in .py: the checker imports it as a Python file.")
    if os.path.lexists(args.path):
        raise UsageError(f"PATH {args.path} exists; name a new file (the template never overwrites one).")
    _write_text_exclusive(args.path, text)
    experts = " --boundary-ratio 0.875" if args.family == "wan" else ""  # the tiny Wan model as two experts
    print(
        f"wrote {args.path}; run it with:\n  rollout-consistency check --rollout-backend {args.path}:make_rollout "
        f"--trainer-backend {args.path}:make_trainer --sde-window-size all --model-family {args.family}{experts}",
        file=sys.stderr,
    )
    return EXIT_PASS


def _write_text_exclusive(path: str, text: str) -> None:
    try:
        with open(path, "x", encoding="utf-8") as handle:  # "x": a file created meanwhile is not overwritten
            handle.write(text)
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from error
