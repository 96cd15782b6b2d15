# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What every sub-command shares: [`UsageError`] (bad input: one line on stderr, exit code 2), the check that
no output path is an input, and the JSON files the training tools read and write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["UsageError", "check_outputs", "read_json", "write_json"]


class UsageError(Exception):
    """Bad input to a command: reported on stderr, exit code 2."""


def check_outputs(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    """`UsageError` when an output path (flag -> path) is one of the inputs or another output, before any work."""
    from rollout_consistency.atomic_write import OutputPathError, check_output_paths

    try:
        check_output_paths(outputs, inputs)
    except OutputPathError as error:
        raise UsageError(str(error)) from error


def write_json(path: str | None, data: dict[str, Any]) -> None:
    from rollout_consistency.atomic_write import write_all

    if path is None:
        return
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    try:
        write_all([(path, lambda temporary: Path(temporary).write_text(text))])
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error}") from error


def read_json(path: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read JSON from {path}: {error}") from error
