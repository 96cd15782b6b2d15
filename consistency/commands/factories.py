# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A user's factory on the command line: ``SPEC`` (``package.module:factory`` or ``path/to/file.py:factory``,
loaded by `rollout_consistency.safeguards.object_spec`) and its ``--arg name=value`` keywords, for the commands that run
the user's own model (`checkpointing`, `precision`)."""

from __future__ import annotations

import argparse
import ast
from collections.abc import Sequence
from typing import Any

from rollout_consistency.safeguards.fence import DEFAULT_TIMEOUT_S, fenced
from rollout_consistency.safeguards.object_spec import SpecError, call_with_supported_kwargs, load_object

from .usage import UsageError

__all__ = ["add_timeout_argument", "call_factory", "load_spec", "parse_factory_args", "timeout"]


def load_spec(spec: str, owner: str, timeout_s: float | None) -> Any:
    """The object `spec` names, its import fenced (`rollout_consistency.safeguards.fence`) as `owner`'s."""

    try:
        return load_object(spec, owner=owner, timeout_s=timeout_s)
    except SpecError as error:
        raise UsageError(str(error)) from error


def call_factory(
    factory: Any, spec: str, optional: dict[str, Any], required: dict[str, Any], *, owner: str, timeout_s: float | None
) -> Any:
    """`factory` called with the `optional` keywords it takes and every `required` one, fenced as `owner`'s."""

    if not callable(factory):
        return factory  # the spec named the object itself
    try:
        with fenced(owner, "the factory", timeout_s=timeout_s):
            return call_with_supported_kwargs(factory, optional=optional, required=required)
    except SpecError as error:
        raise UsageError(f"{spec}: {error}") from error
    except (TypeError, ValueError) as error:  # the factory refused its arguments (e.g. --arg dropout=abc)
        given = ", ".join(f"{k}={v!r}" for k, v in required.items()) or "no --arg"
        raise UsageError(
            f"{spec} raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
            f"(called with {given}); check the --arg values."
        ) from error


def add_timeout_argument(parser: argparse.ArgumentParser) -> None:
    """``--user-code-timeout-s``: the bound on each call into the user's code (`rollout_consistency.safeguards.fence`)."""

    parser.add_argument(
        "--user-code-timeout-s",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"bound on each call into your code (import, factory, the check) (default {DEFAULT_TIMEOUT_S:g})",
    )


def timeout(args: argparse.Namespace) -> float:
    """The parsed ``--user-code-timeout-s``, inside its bound (`rollout_consistency.gate.config.BOUNDS`)."""
    from rollout_consistency.gate.config import BOUNDS  # the settings load numpy: not for `--help`

    low, high = BOUNDS["user_code_timeout_s"]
    if not low <= args.user_code_timeout_s <= high:
        raise UsageError(f"--user-code-timeout-s {args.user_code_timeout_s} must lie in [{low:g}, {high:g}].")
    return args.user_code_timeout_s


def parse_factory_args(pairs: Sequence[str]) -> dict[str, Any]:
    """`name=value` pairs; values are Python literals (numbers, strings, lists), else plain strings."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"--arg expects name=value, got {pair!r}")
        try:
            kwargs[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            kwargs[name] = text
    return kwargs
