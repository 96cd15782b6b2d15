# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Integrity-checked capture files: one JSON header line, then the `torch.save` payload.

The header holds the format name, the format version, and the size and SHA-256 of the payload. [`read_checked`]
verifies all of it before anything is unpickled, so a truncated, zero-byte, edited or bit-flipped capture is
refused with [`CaptureFormatError`] naming the problem instead of failing deep inside `torch.load` (or, for a
flipped bit in the stored weights, replaying silently with other numbers).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from typing import Any, BinaryIO

from rollout_consistency.safeguards.memory_budget import check_fits
from rollout_consistency.safeguards.paths import open_regular

__all__ = ["MAX_HEADER_BYTES", "CaptureFormatError", "read_checked", "write_checked"]

MAX_HEADER_BYTES = 4096


class CaptureFormatError(ValueError):
    """A capture file that is damaged, truncated, of another format or of another version."""


def write_checked(payload: Any, file: BinaryIO, format_name: str, version: int) -> None:
    """Write `payload` (anything `torch.save` takes) behind a header with its size and SHA-256."""
    import torch

    buffer = io.BytesIO()
    torch.save(payload, buffer)
    data = buffer.getvalue()
    header = {"format": format_name, "version": version, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    file.write(json.dumps(header, sort_keys=True).encode() + b"\n")
    file.write(data)


def read_checked(path: str | os.PathLike[str], format_name: str, version: int) -> io.BytesIO:
    """The verified payload of a capture file, ready for `torch.load`.

    Raises:
        FileNotFoundError: no such file.
        rollout_consistency.safeguards.paths.InputPathError: a FIFO, a device, a socket, or a permission error.
        rollout_consistency.safeguards.memory_budget.MemoryBudgetError: the payload cannot fit the memory left.
        CaptureFormatError: empty, truncated, trailing bytes, checksum mismatch, another format or version.
    """

    with open_regular(path, "capture") as handle:  # a FIFO or a device is refused, never read
        size = os.fstat(handle.fileno()).st_size
        line = handle.readline(MAX_HEADER_BYTES)
        try:
            header = json.loads(line) if line.endswith(b"\n") else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
        if not isinstance(header, dict) or header.get("format") != format_name:
            what = "is empty" if size == 0 else "has no capture header"
            raise CaptureFormatError(
                f"{path} {what}: it is not a NaN-capture file written by rollout_consistency.training.nan_capture (or one "
                f"written before format version {version}, which had no checksum); capture the step again."
            )
        if header.get("version") != version:
            raise CaptureFormatError(
                f"{path} has capture format version {header.get('version')!r}; this code reads {version}. Replay "
                f"with the rollout-consistency version that wrote it, or capture again."
            )
        expected = header.get("bytes")
        if not isinstance(expected, int) or expected != size - len(line):
            raise CaptureFormatError(
                f"{path}: the header announces {expected} payload bytes but the file holds {size - len(line)}; the "
                f"capture is truncated or has trailing bytes (copy it again, or capture the step again)."
            )
        # The payload is held twice (the bytes, then the unpickled tensors) and hashed: refuse what cannot fit.
        check_fits(3 * expected, f"loading the capture {path} ({expected} bytes)", "replay it on a larger machine")
        data = handle.read(expected)
    if hashlib.sha256(data).hexdigest() != header.get("sha256"):
        raise CaptureFormatError(
            f"{path}: checksum mismatch — the capture changed after it was written (corruption or an edit); its "
            f"weights cannot be trusted to reproduce the step. Capture the step again."
        )
    return io.BytesIO(data)
