# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""All-or-nothing report files: every output is written beside its target, then all are renamed into place.

[`write_all`] takes ``(path, write)`` pairs, where ``write(temp_path)`` writes one report (JSON, JUnit XML, a
PNG) to the path it is given. Each goes to a fresh temporary file in its target's directory (same file
system, so the rename is atomic), is flushed to disk, and only when every write succeeded are the temporary
files renamed onto their targets. On any failure or interrupt (disk full, a file-size limit, Ctrl-C) the
temporary files are removed and no target is touched: a pre-existing report stays whole, and no report is
left that disagrees with the exit code. Two runs writing one path never tear it: each renames its own
complete file, and the last rename wins.

[`check_output_paths`] is the matching usage check: an empty output path (``--json ''``), an output equal to an
input, to another output, or to a directory is refused before any work starts.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from rollout_consistency.supervisor import announce_temp

__all__ = ["OutputPathError", "check_output_paths", "write_all"]

TEMP_PREFIX = ".rc-tmp-"


class OutputPathError(ValueError):
    """An output path that would overwrite an input or another output, or that cannot be a file."""


def check_output_paths(outputs: Mapping[str, str | None], inputs: Mapping[str, str | None]) -> None:
    """Refuse outputs that would destroy something: raises [`OutputPathError`] naming the flags and the fix.

    Args:
        outputs: flag -> path of each requested output (``None``: not requested; ``""``: refused).
        inputs: flag -> path of each input file the run reads (``None``: not given).

    Paths are compared after resolving symlinks, so a link to the config file counts as the config file.
    """
    real_inputs = {os.path.realpath(path): flag for flag, path in inputs.items() if path}
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        if not str(path).strip():  # `--json ''` (an unset shell variable) would silently write nothing
            raise OutputPathError(f"{flag} was given an empty path; name the file to write (or drop {flag}).")
        real = os.path.realpath(path)
        if real in real_inputs:
            raise OutputPathError(
                f"{flag} {path} is the file given to {real_inputs[real]}; writing the report there would destroy "
                f"it. Write the report to another file."
            )
        if real in seen:
            raise OutputPathError(f"{flag} and {seen[real]} both write {path}; give each output its own file.")
        if os.path.isdir(real):
            raise OutputPathError(f"{flag} {path} is a directory; name a file (e.g. {os.path.join(path, 'report')}).")
        seen[real] = flag


def write_all(writes: Iterable[tuple[str | os.PathLike[str], Callable[[str], None]]]) -> list[Path]:
    """Write every report to a temporary file beside its target, then rename all into place.

    Args:
        writes: ``(target, write)`` pairs; ``write(temp_path)`` writes the complete file to ``temp_path``.

    Returns:
        The targets, in order.

    Raises:
        OSError: a write or rename failed (nothing was renamed into place, no temporary file is left), or
            whatever ``write`` raised. KeyboardInterrupt leaves nothing behind either.
    """
    pending: list[tuple[Path, str]] = []
    try:
        for target, write in writes:
            target = Path(target)
            if target.parent != Path(""):
                target.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=TEMP_PREFIX + target.name + ".", dir=target.parent or ".")
            os.close(fd)
            announce_temp(temporary)  # the supervisor removes it if this process is killed before the rename
            pending.append((target, temporary))
            os.chmod(temporary, 0o644)  # mkstemp's 0600 would make shared CI reports unreadable
            write(temporary)
            _fsync(temporary)
        for target, temporary in pending:
            os.replace(temporary, target)
    except BaseException:
        for _, temporary in pending:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise
    return [target for target, _ in pending]


def _fsync(path: str) -> None:
    # A full disk can surface only at flush time; fsync makes the failure visible before the rename.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
