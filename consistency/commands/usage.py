# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What every sub-command shares: [`UsageError`] (bad input: one line on stderr, exit code 2), the check that
no output path is an input, and the JSON files the training tools read and write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout_consistency.safeguards.atomic_write import write_all
from rollout_consistency.safeguards.memory_budget import MemoryBudgetError, check_fits
from rollout_consistency.safeguards.output_paths import OutputPathError, OutputTarget, check_output_paths
from rollout_consistency.safeguards.paths import InputPathError, check_input_file

__all__ = ["MAX_REPORT_BYTES", "UsageError", "check_outputs", "check_report_file", "read_json", "write_json"]

#: Largest report a command reads (a report of 65536 samples is a few tens of MB); parsing takes about 10x.
MAX_REPORT_BYTES = 256 << 20


class UsageError(Exception):
    """Bad input to a command: reported on stderr, exit code 2."""


def check_outputs(
    outputs: dict[str, str | None],
    inputs: dict[str, str | None],
    *,
    directories_read: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, OutputTarget]:
    """Every requested output (flag -> path) resolved and checked before any work
    (`rollout_consistency.safeguards.output_paths.check_output_paths`): flag -> target of each one given. `UsageError` when
    one is an input, a file read inside an input directory (`directories_read`), another output, a directory or a
    device other than /dev/null; a relative path is fixed now, whatever the run does to the working directory."""
    try:
        return check_output_paths(outputs, inputs, directories_read=directories_read)
    except OutputPathError as error:
        raise UsageError(str(error)) from error


def write_json(target: OutputTarget | str | None, data: dict[str, Any]) -> None:
    """Write `data` as JSON to a target `check_outputs` returned (a plain path is resolved now; None: not
    requested)."""

    if target is None:
        return
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    try:
        write_all([(target, lambda temporary: Path(temporary).write_text(text))])
    except OSError as error:
        raise UsageError(f"cannot write {getattr(target, 'given', target)}: {error.strerror or error}") from error


def check_report_file(path: str, what: str) -> None:
    """A report input: a readable regular file of at most MAX_REPORT_BYTES whose parse fits the memory left."""

    try:
        size = check_input_file(path, what, max_bytes=MAX_REPORT_BYTES)
        check_fits(12 * size, f"reading {what} {path} ({size} bytes)", "free memory or raise the memory limit")
    except FileNotFoundError as error:
        raise UsageError(f"cannot read JSON from {path} ({what}): no such file.") from error
    except (InputPathError, MemoryBudgetError) as error:
        raise UsageError(str(error)) from error


def read_json(path: str, what: str) -> Any:
    """The JSON document in the report file `path` (`what` names it in errors), checked first (`check_report_file`)."""
    check_report_file(path, what)
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read JSON from {path}: {error}") from error
