# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""All-or-nothing report files: every output is written in full first, then all are put in place together.

[`write_all`] takes ``(target, write)`` pairs, where ``write(temp_path)`` writes one report (JSON, JUnit XML, a
PNG) to the path it is given. A target is an `rollout_consistency.safeguards.output_paths.OutputTarget` (a command resolves
its outputs when it starts, `check_output_paths`) or a path, resolved here:

* a file goes to a fresh temporary file in its target's directory (same file system, so the rename is
  atomic) and is flushed to disk;
* ``/dev/null``, a pipe, or the process's stdout/stderr (``/dev/stdout``) gets its report written to a
  temporary file first, then copied to the device or stream directly — a device is never renamed over (as root
  that would replace ``/dev/null`` with a regular file).

Only when every report was written are the streams fed and the temporary files renamed onto their targets.
On any failure or interrupt (disk full, a file-size limit, Ctrl-C, a pipe nobody reads) the temporary files
are removed and no target is touched: a pre-existing report stays whole, and no report is left that disagrees
with the exit code. Just before its rename each target is checked again: a path that became a device, a FIFO
or a directory is not written over.

**Pairs.** The renames of one call happen under an exclusive lock (``flock``) on each target's directory,
taken in one order ([`reports_lock`]). Two runs writing the same ``--json`` and ``--junit`` therefore leave
both files from the same run (the last to rename), and neither file is ever torn. Not guaranteed: a reader
that does not hold [`reports_lock`] may read between two renames of one run (one file new, one old); on a file
system without ``flock`` (some network file systems) the renames are unlocked (each file still whole); bytes
sent to a stream or a pipe cannot be taken back.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from rollout_consistency.safeguards.cli_guard import raise_if_interrupted
from rollout_consistency.safeguards.output_paths import OutputTarget, resolve_output
from rollout_consistency.safeguards.supervisor import announce_temp

__all__ = ["LOCK_WAIT_S", "TEMP_PREFIX", "reports_lock", "write_all"]

TEMP_PREFIX = ".rc-tmp-"
#: Longest wait for another run's renames (each holds the lock for microseconds; a longer hold is a stopped run).
LOCK_WAIT_S = 30.0

Target = str | os.PathLike[str] | OutputTarget


def write_all(writes: Iterable[tuple[Target, Callable[[str], None]]]) -> list[OutputTarget]:
    """Write every report in full, then copy the streamed ones and rename the files into place.

    Args:
        writes: ``(target, write)`` pairs; ``write(temp_path)`` writes the complete file to ``temp_path``.

    Returns:
        The targets, resolved, in order.

    Raises:
        OSError: a write, a copy to a stream or a rename failed (no file was renamed into place, no temporary
            file is left), or whatever ``write`` raised. KeyboardInterrupt leaves nothing behind either.
        rollout_consistency.safeguards.output_paths.OutputPathError: a path that cannot be a report (a directory, a device
            other than ``/dev/null``, a socket), before anything is written.
    """
    pending: list[tuple[OutputTarget, str]] = []
    try:
        for given, write in writes:
            target = resolve_output(given)
            if target.kind == "file":
                directory, name = os.path.split(target.path)
                os.makedirs(directory, exist_ok=True)
            else:  # the bytes are copied to the device or stream: the temporary lives in the temp folder
                directory, name = tempfile.gettempdir(), "stream"
            fd, temporary = tempfile.mkstemp(prefix=TEMP_PREFIX + name + ".", dir=directory)
            os.close(fd)
            announce_temp(temporary)  # the supervisor removes it if this process is killed before the rename
            pending.append((target, temporary))
            os.chmod(temporary, 0o644)  # mkstemp's 0600 would make shared CI reports unreadable
            write(temporary)
            if target.kind == "file":
                _fsync(temporary)
        raise_if_interrupted()  # a Ctrl-C swallowed earlier (in an at-fork hook, a __del__) still writes nothing
        for target, temporary in pending:
            if target.kind != "file":
                _copy_to_device(target, temporary)
        files = [(target, temporary) for target, temporary in pending if target.kind == "file"]
        with reports_lock([target.path for target, _ in files]):
            for target, temporary in files:
                _refuse_non_regular(target.path)
                os.replace(temporary, target.path)
    except BaseException:
        for _, temporary in pending:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        raise
    for target, temporary in pending:
        if target.kind != "file":
            with contextlib.suppress(OSError):
                os.unlink(temporary)
    return [target for target, _ in pending]


@contextlib.contextmanager
def reports_lock(paths: Iterable[str | os.PathLike[str]], *, wait_s: float | None = None) -> Iterator[None]:
    """Hold the lock under which [`write_all`] renames reports into place: the directories of `paths`, in one
    order. A reader that holds it while reading a run's JSON and JUnit sees both from the same run.

    Raises:
        OSError: another process held a directory's lock for more than `wait_s` seconds (default
            `LOCK_WAIT_S`; a stopped run), or a directory cannot be opened.
    """
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    try:
        import fcntl
    except ImportError:  # Windows: no flock; the renames are unlocked (each file still whole)
        yield
        return
    handles: list[int] = []
    try:
        for directory in sorted({os.path.dirname(os.path.abspath(path)) for path in paths}):
            handle = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
            handles.append(handle)
            _flock(fcntl, handle, directory, wait_s)
        yield
    finally:
        for handle in handles:
            os.close(handle)  # closing the descriptor releases its lock


def _flock(fcntl: object, handle: int, directory: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # type: ignore[attr-defined]
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise OSError(
                    errno.ETIMEDOUT,
                    f"another process has held the reports' lock on this folder for {wait_s:g} s (a stopped "
                    f"rollout-consistency run?); end it or write the reports elsewhere",
                    directory,
                ) from None
            time.sleep(0.005)
        except OSError as error:
            if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF):
                return  # no flock on this file system: renamed unlocked (module docstring)
            raise


def _refuse_non_regular(path: str) -> None:
    """Raise OSError when `path` exists and is neither a regular file nor a symlink (it became a device, a FIFO
    or a directory after the command started): a report is never renamed over it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise OSError(
            errno.EEXIST, "is no longer a regular file (a device, a FIFO or a folder); not written over", path
        )


def _copy_to_device(target: OutputTarget, temporary: str) -> None:
    """Write the report in `temporary` to the stream, null device or pipe `target`, directly."""
    data = Path(temporary).read_bytes()
    if target.kind == "stream":
        for stream in (sys.stdout, sys.stderr):  # what was printed comes first
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        _write_fully(target.fd, data)  # type: ignore[arg-type]
        return
    try:  # never blocks (a pipe nobody reads is ENXIO) and never creates or truncates anything
        handle = os.open(target.path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        if error.errno == errno.ENXIO:
            raise OSError(errno.ENXIO, "no process reads this pipe; start its reader first", target.path) from error
        raise
    try:
        info = os.fstat(handle)
        same = stat.S_ISFIFO(info.st_mode) if target.kind == "fifo" else info.st_rdev == os.stat(os.devnull).st_rdev
        if not same:  # swapped since the command started: never write a report into another device
            raise OSError(errno.EEXIST, f"is no longer the {target.kind} it was when the command started", target.path)
        os.set_blocking(handle, True)
        _write_fully(handle, data)
    finally:
        os.close(handle)


def _write_fully(handle: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(handle, view) :]


def _fsync(path: str) -> None:
    # A full disk can surface only at flush time; fsync makes the failure visible before the rename.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
