# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Output paths: resolved and checked once, when a command starts, so that no report is written over what is
not the command's to write.

Every command that writes a file (``--json``, ``--junit``, ``--plot``, ``--output``) calls
[`check_output_paths`] before any work and hands the [`OutputTarget`] it returns to
`rollout_consistency.safeguards.atomic_write.write_all`. A target is one of four kinds:

* ``"file"``: a regular file or a new one. Its path is made absolute and its symlinks resolved *now*, so a
  plug-in that changes the working directory cannot move the report, and a symlink's target is written (the
  link stays). Written beside its target and renamed into place.
* ``"stream"``: the file the process's standard output or standard error already is (``/dev/stdout``,
  ``/dev/stderr``, or the file that ``> out.txt`` made stdout): the bytes are written through that open
  descriptor, after what was printed, never by opening the path again (which would truncate it) or renaming over
  it.
* ``"null"``: the null device (``/dev/null``): written to directly (the report is discarded), never renamed
  over — as root a rename would replace the device node with a regular file.
* ``"fifo"``: a named pipe or a shell's ``>(...)`` pipe: written to directly; opened without blocking when the
  reports are written, so a pipe nobody reads is an error (exit 2), not a hang.

Refused, each with one line naming the fix ([`OutputPathError`]): an empty path; a path that is an input of
the command (the config, a trajectory, a dump, a report read, a plug-in's or a spec's source file, a linted
file) — symlinks resolved; an existing file the command reads inside an input directory (a model directory's
files, the ``.py`` files of a linted folder); two outputs naming one file; a directory; any other device (a
block device, ``/dev/full``, ``/dev/mem``: writing a report there destroys data or never means anything); a
socket; the supervisor's own pipe.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from rollout_consistency.safeguards.supervisor import is_channel

__all__ = ["OutputPathError", "OutputTarget", "check_output_paths", "resolve_output"]

#: The kinds of target, see the module docstring.
KINDS = ("file", "stream", "null", "fifo")


class OutputPathError(ValueError):
    """An output path that would overwrite something not the command's, or that cannot be a report file."""


@dataclass(frozen=True)
class OutputTarget:
    """Where one report goes, decided when the command started.

    Attributes:
        given: the path as the user wrote it (for messages).
        path: the absolute path (symlinks resolved for a ``"file"``; as given, made absolute, for the others).
        kind: ``"file"``, ``"stream"``, ``"null"`` or ``"fifo"`` (module docstring).
        fd: the open descriptor a ``"stream"`` is written through (1 or 2); None for the other kinds.
    """

    given: str
    path: str
    kind: str
    fd: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"OutputTarget kind must be one of {KINDS}, got {self.kind!r}.")
        if (self.kind == "stream") != (self.fd is not None):
            raise ValueError("an OutputTarget has a descriptor exactly when it is a stream.")

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path


def resolve_output(path: str | os.PathLike[str] | OutputTarget, flag: str = "") -> OutputTarget:
    """The [`OutputTarget`] of one output path (an `OutputTarget` is returned as it is).

    Args:
        path: the path the user gave.
        flag: how the command names the output (``"--json"``; ``""``: the path alone), for messages.

    Raises:
        OutputPathError: an empty path, a directory, a device other than the null device, a socket, or the
            supervisor's pipe.
    """
    if isinstance(path, OutputTarget):
        return path
    given = os.fspath(path)
    label = f"{flag} {given}" if flag else given
    if not given.strip():  # `--json ''` (an unset shell variable) would silently write nothing
        raise OutputPathError(f"{flag or 'an output'} was given an empty path; name the file to write.")
    absolute = os.path.abspath(given)
    try:
        info = os.stat(absolute)
    except FileNotFoundError:
        return OutputTarget(given, os.path.realpath(absolute), "file")  # a new file (or a dangling link's target)
    except NotADirectoryError as error:
        raise OutputPathError(f"{label}: a folder on its path is a file; name a path under a folder.") from error
    except OSError as error:
        raise OutputPathError(f"{label} cannot be checked ({error.strerror or error}); check the path.") from error
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        raise OutputPathError(f"{label} is a directory; name a file (e.g. {os.path.join(given, 'report')}).")
    stream = _standard_stream(info)
    if stream is not None:
        return OutputTarget(given, absolute, "stream", fd=stream)
    if stat.S_ISREG(mode):
        return OutputTarget(given, os.path.realpath(absolute), "file")
    if stat.S_ISCHR(mode) and info.st_rdev == _null_device():
        return OutputTarget(given, absolute, "null")
    if stat.S_ISFIFO(mode):
        if is_channel(info):
            raise OutputPathError(f"{label} is the command's own pipe to its supervisor; name a file.")
        return OutputTarget(given, absolute, "fifo")
    kind = "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket"
    raise OutputPathError(
        f"{label} is {kind}; a report is written only to a file, /dev/null, /dev/stdout, /dev/stderr or a pipe. "
        f"Name a file."
    )


def check_output_paths(
    outputs: Mapping[str, str | None],
    inputs: Mapping[str, str | None],
    *,
    directories_read: Mapping[str, tuple[str, ...]] | None = None,
) -> dict[str, OutputTarget]:
    """Resolve and check every requested output before any work; flag -> target of each one given.

    Args:
        outputs: flag -> path of each requested output (``None``: not requested; ``""``: refused).
        inputs: flag -> path of each input the run reads (``None``: not given). Symlinks are resolved, so a link
            to the config file counts as the config file.
        directories_read: flag (of `inputs`) -> suffixes of the files the command reads inside that input when
            it is a directory (``()``: every file): an output that is such an existing file is refused.

    Raises:
        OutputPathError: naming the flags and the fix (see the module docstring).
    """
    real_inputs = {os.path.realpath(path): flag for flag, path in inputs.items() if path}
    folders = {
        os.path.realpath(inputs[flag]): (flag, suffixes)
        for flag, suffixes in (directories_read or {}).items()
        if inputs.get(flag) and os.path.isdir(inputs[flag] or "")
    }
    targets: dict[str, OutputTarget] = {}
    seen: dict[str, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        target = resolve_output(path, flag)
        if target.kind == "file":
            _check_not_an_input(flag, target, real_inputs, folders)
        if target.kind != "null":  # any number of reports may be discarded
            if target.path in seen:
                raise OutputPathError(
                    f"{flag} and {seen[target.path]} both write {path}; give each output its own file."
                )
            seen[target.path] = flag
        targets[flag] = target
    return targets


def _check_not_an_input(
    flag: str, target: OutputTarget, real_inputs: dict[str, str], folders: dict[str, tuple[str, tuple[str, ...]]]
) -> None:
    if target.path in real_inputs:
        raise OutputPathError(
            f"{flag} {target.given} is the file given to {real_inputs[target.path]}; writing the report there would "
            f"destroy it. Write the report to another file."
        )
    if not os.path.isfile(target.path):
        return
    for folder, (input_flag, suffixes) in folders.items():
        inside = os.path.commonpath([folder, target.path]) == folder
        if inside and (not suffixes or target.path.endswith(suffixes)):
            raise OutputPathError(
                f"{flag} {target.given} is a file {input_flag} reads; writing the report there would destroy it. "
                f"Write the report outside {input_flag}."
            )


def _standard_stream(info: os.stat_result) -> int | None:
    """1 or 2 when `info` is the file this process's stdout or stderr is (a terminal, a pipe, a redirect)."""
    for fd in (1, 2):
        try:
            own = os.fstat(fd)
        except OSError:
            continue
        if (own.st_dev, own.st_ino) == (info.st_dev, info.st_ino):
            return fd
    return None


def _null_device() -> int | None:
    try:
        return os.stat(os.devnull).st_rdev
    except OSError:
        return None
