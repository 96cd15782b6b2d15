# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A user's factory on the command line: ``SPEC`` (``package.module:factory`` or ``path/to/file.py:factory``,
loaded by `rollout_consistency.object_spec`) and its ``--arg name=value`` keywords, for the commands that run
the user's own model (`checkpointing`, `precision`)."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

from .usage import UsageError

__all__ = ["call_factory", "load_spec", "parse_factory_args", "spec_file"]


def load_spec(spec: str) -> Any:
    from rollout_consistency.object_spec import SpecError, load_object

    try:
        return load_object(spec)
    except SpecError as error:
        raise UsageError(str(error)) from error


def call_factory(factory: Any, spec: str, optional: dict[str, Any], required: dict[str, Any]) -> Any:
    from rollout_consistency.object_spec import SpecError, call_with_supported_kwargs

    if not callable(factory):
        return factory  # the spec named the object itself
    try:
        return call_with_supported_kwargs(factory, optional=optional, required=required)
    except SpecError as error:
        raise UsageError(f"{spec}: {error}") from error
    except (TypeError, ValueError) as error:  # the factory refused its arguments (e.g. --arg dropout=abc)
        given = ", ".join(f"{k}={v!r}" for k, v in required.items()) or "no --arg"
        raise UsageError(
            f"{spec} raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''} "
            f"(called with {given}); check the --arg values."
        ) from error


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


def spec_file(spec: str | None) -> str | None:
    """The file a 'path/to/file.py:factory' spec names (None for a module spec)."""
    module_part = (spec or "").rpartition(":")[0]
    return module_part if module_part.endswith(".py") else None
