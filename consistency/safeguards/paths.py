# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Input paths: refuse, before anything is read, what would block, never end or exhaust memory.

Every command that reads a path (a config, a trajectory, a dump, a report, a capture, a spec's file, a linted
file) calls [`check_input_file`] (or [`refuse_special`]) first:

* a FIFO, a character or block device or a socket is refused with one line — reading a FIFO blocks until a
  writer comes, ``/dev/zero`` never ends;
* a path that exists but cannot be read says *permission*, not "no such file";
* with ``max_bytes``, a file larger than the bound is refused unread.

[`open_regular`] opens without blocking (``O_NONBLOCK``) and checks the opened file itself, so a FIFO swapped
in after the check still cannot block the reader. The errors are [`InputPathError`] (a ``ValueError``): the
command line turns them into exit code 2.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO

__all__ = ["InputPathError", "check_input_file", "open_regular", "refuse_special", "special_kind"]


class InputPathError(ValueError):
    """An input path that cannot be read as a regular file; the message is one line naming the fix."""


def special_kind(path: str | os.PathLike[str]) -> str | None:
    """What `path` is when it is not a regular file or a directory ("a FIFO (named pipe)", ...), else None.

    Symlinks are followed; a missing path or one whose status cannot be read gives None (the caller's own
    open reports it).
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return _kind(mode)


def _kind(mode: int) -> str | None:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return None


def refuse_special(path: str | os.PathLike[str], what: str) -> None:
    """Raise [`InputPathError`] when `path` is a FIFO, a device or a socket.

    Args:
        path: the input path.
        what: how the command names the input (``"--config"``, ``"DUMP"``, ``"trajectory"``; ``""``: the
            path alone, for a caller that names the input itself).
    """
    kind = special_kind(path)
    if kind is not None:
        raise InputPathError(_special_message(path, what, kind))


def _special_message(path: str | os.PathLike[str], what: str, kind: str) -> str:
    return (
        f"{_label(path, what)} is {kind}, not a regular file: reading it could block or never end; "
        f"write the data to a file and pass that file."
    )


def check_input_file(path: str | os.PathLike[str], what: str, *, max_bytes: int | None = None) -> int:
    """Check that `path` is a readable regular file of at most `max_bytes` bytes; returns its size.

    Raises:
        FileNotFoundError: no such file (the caller words it for its command).
        InputPathError: a directory, a FIFO, a device or a socket, a file that cannot be read (permission),
            or one larger than `max_bytes`.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise
    except OSError as error:
        raise InputPathError(_os_message(path, what, error)) from error
    if stat.S_ISDIR(info.st_mode):
        raise InputPathError(f"{_label(path, what)} is a directory; name the file inside it.")
    kind = _kind(info.st_mode)
    if kind is not None:
        raise InputPathError(_special_message(path, what, kind))
    if not os.access(path, os.R_OK):
        raise InputPathError(
            f"{_label(path, what)}: permission denied (the file exists but this user may not read it); "
            f"fix its permissions (chmod u+r) or run as its owner."
        )
    if max_bytes is not None and info.st_size > max_bytes:
        raise InputPathError(
            f"{_label(path, what)} is {info.st_size} bytes, more than the {max_bytes} this input may hold; "
            f"is this the right file?"
        )
    return info.st_size


def open_regular(path: str | os.PathLike[str], what: str) -> BinaryIO:
    """Open `path` for reading in binary mode, refusing anything but a regular file without ever blocking.

    Raises:
        FileNotFoundError: no such file.
        InputPathError: a directory, a FIFO, a device or a socket, or a permission error.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as error:
        raise InputPathError(_os_message(path, what, error)) from error
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise InputPathError(f"{_label(path, what)} is a directory; name the file inside it.")
        kind = _kind(mode)
        if kind is not None:
            raise InputPathError(_special_message(path, what, kind))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _label(path: str | os.PathLike[str], what: str) -> str:
    return f"{what} {os.fspath(path)}" if what else os.fspath(path)


def _os_message(path: str | os.PathLike[str], what: str, error: OSError) -> str:
    if error.errno in (errno.EACCES, errno.EPERM):
        return (
            f"{_label(path, what)}: permission denied (it exists but this user may not read it or its "
            f"folder); fix the permissions or run as its owner."
        )
    if error.errno == errno.ELOOP:
        return f"{_label(path, what)} cannot be read (a symlink loop); point it at the file."
    if error.errno == errno.EISDIR:
        return f"{_label(path, what)} is a directory; name the file inside it."
    return f"{_label(path, what)} cannot be read ({error.strerror or error}); check the path."
