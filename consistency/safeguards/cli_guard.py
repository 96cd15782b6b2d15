# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The command line's last line of defence: one exit code per outcome, never a traceback.

[`guarded`] runs a command's ``main`` and maps what escapes it:

* 0 PASS, 1 FAIL: returned by the command itself (1 only when the two sides disagree);
* 2 could not run: a usage error, an unreadable or invalid input, a resource limit (disk full, file-size
  limit, out of memory), an unreachable cluster, or an unexpected error — printed as one line naming the
  problem and the fix; ``--debug`` prints the traceback too;
* 130 interrupted: Ctrl-C, SIGTERM or SIGHUP (the commands' ``finally`` blocks and the all-or-nothing report
  writer remove their temporary files and Ray processes on the way out). A second SIGINT, SIGTERM or SIGHUP within
  a second of the first is the same interrupt (a terminal's Ctrl-C reaches the supervisor and its child both,
  and the supervisor forwards it): the clean-up is not interrupted in turn.

A closed stdout or stderr (``rollout-consistency check --json r.json 2>&1 | head``) is not an error: further
output is discarded and the exit code stays the verdict's. User code that ends or overruns a fenced call
(`rollout_consistency.safeguards.fence`), an input path that is a FIFO, a device or a socket (`rollout_consistency.safeguards.paths`)
and an input too large for the memory left (`rollout_consistency.safeguards.memory_budget`) are usage errors (2); an
out-of-memory error names a fix that fits the command.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence

from rollout_consistency.safeguards.fence import UserCodeError
from rollout_consistency.safeguards.memory_budget import MemoryBudgetError
from rollout_consistency.safeguards.paths import InputPathError

__all__ = [
    "EXIT_FAIL",
    "EXIT_INTERRUPTED",
    "EXIT_PASS",
    "EXIT_USAGE",
    "guarded",
    "raise_if_interrupted",
    "split_debug",
]

EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130

#: What to do about running out of memory, by command (the first word of the command line).
_MEMORY_FIXES = {
    "check": "lower the image size, batch size or number of samples",
    "gate": "gate fewer samples (a dump of fewer rows) or raise the memory limit",
    "doctor": "the report is too large for the memory left; free memory or raise the memory limit",
    "checkpointing": "shrink the factory's module or inputs",
    "recompute": "shrink the factory's module or inputs",
    "precision": "shrink the factory's model, or compare smaller reports",
    "lint": "lint fewer or smaller files",
}

_RESOURCE_FIXES = {
    errno.ENOSPC: "free disk space or write the reports elsewhere",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or write the reports elsewhere",
    errno.EDQUOT: "free space in your quota or write the reports elsewhere",
    errno.EACCES: "check the permissions of the path",
    errno.EROFS: "write to a writable file system",
    errno.ELOOP: "fix the symlink loop",
    errno.EISDIR: "name a file, not a directory",
}


def split_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """`argv` without its ``--debug`` flags (before a ``--``), and whether one was given."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    debug = "--debug" in argv[:end]
    return [a for i, a in enumerate(argv) if i >= end or a != "--debug"], debug


def guarded(run: Callable[[list[str]], int], argv: Sequence[str] | None, prog: str) -> int:
    """``run(argv)`` with every escaping exception turned into an exit code and one line on stderr."""

    argv, debug = split_debug(sys.argv[1:] if argv is None else argv)
    try:
        with _signals_as_interrupt(), _tolerate_closed_streams():
            code = run(argv)
            raise_if_interrupted()  # an interrupt that was swallowed still ends the command as one
            return code
    except KeyboardInterrupt:
        _say(prog, "interrupted; no report was written (reports are written all at once at the end).", debug)
        _forget_interrupt_inside_exec()
        return EXIT_INTERRUPTED
    except (UserCodeError, InputPathError, MemoryBudgetError) as error:
        _say(prog, _first_line(getattr(error, "cause", None) or error), debug)  # a Ray task error wraps the cause
        return EXIT_USAGE
    except MemoryError:
        fix = _MEMORY_FIXES.get(_command(argv), "free memory or raise the memory limit")
        _say(prog, f"out of memory; {fix}.", debug)
        return EXIT_USAGE
    except OSError as error:
        where = f" {error.filename}" if error.filename else ""
        fix = _RESOURCE_FIXES.get(error.errno or 0, "check the path and try again")
        detail = str(error.strerror or error).rstrip(".")  # library messages often end in a period
        _say(prog, f"cannot access{where}: {detail}; {fix}.", debug)
        return EXIT_USAGE
    except RecursionError:
        _say(prog, "input nested too deeply to process; simplify it.", debug)
        return EXIT_USAGE
    except Exception as error:  # a bug or an input no check anticipated: could not run, never a FAIL
        _say(prog, f"could not run ({type(error).__name__}: {_first_line(error)}); {_debug_hint(debug)}", debug)
        return EXIT_USAGE


def _command(argv: Sequence[str]) -> str:
    return next((word for word in argv if not word.startswith("-")), "")


def _forget_interrupt_inside_exec() -> None:
    # CPython marks the process as "killed by Ctrl-C" when a KeyboardInterrupt leaves any exec() of a string
    # (dataclasses and namedtuple build their methods that way, so a Ctrl-C during imports often lands there),
    # even though we catch it; at exit the interpreter then kills itself with SIGINT instead of returning 130.
    # Every exec() of a string clears that mark before it runs, so one harmless exec() restores our exit code.
    exec("None", {})


def _say(prog: str, message: str, debug: bool) -> None:
    if debug:
        traceback.print_exc(file=sys.stderr)
    with contextlib.suppress(OSError, ValueError):
        print(f"{prog}: error: {message}", file=sys.stderr)


def _debug_hint(debug: bool) -> str:
    return "the traceback is above; please report it." if debug else "run again with --debug for the traceback."


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:500] if lines else "no message"


#: A second interrupt this soon after the first is the same one (delivered twice: to a process group, and
#: forwarded by the supervisor).
_SAME_INTERRUPT_S = 1.0

#: Signals are process-wide, and so is this record of one: the handler's KeyboardInterrupt is lost when it lands
#: in code whose exceptions CPython swallows ("Exception ignored in": an at-fork hook while Ray starts its
#: workers, a ``__del__``), so the handler also sets this, and the reports and the exit code read it.
_INTERRUPTED = threading.Event()


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt when a command's interrupt arrived and was swallowed before it could stop the command
    (called before reports are put in place, `rollout_consistency.safeguards.atomic_write.write_all`)."""
    if _INTERRUPTED.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    # SIGTERM (CI cancelling a job) cleans up like Ctrl-C; signal handlers can only be set on the main thread.
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    last: list[float] = []

    def interrupt(_signum: int, _frame: object) -> None:
        now = time.monotonic()
        if last and now - last[0] < _SAME_INTERRUPT_S:
            return
        last[:] = [now]
        _INTERRUPTED.set()
        raise KeyboardInterrupt

    _INTERRUPTED.clear()
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, interrupt)}
    # A closed terminal (SIGHUP) too; under nohup it is ignored and stays ignored.
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, interrupt)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # an ignored SIGINT stays ignored
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _INTERRUPTED.clear()  # the record lives while a command runs: code after it (a caller's, a test) starts clean


class _ClosedPipeSafe:
    """A stdout/stderr that drops output once the reader went away (and stops Python's exit-time flush error)."""

    def __init__(self, stream: object) -> None:
        self._stream = stream
        self._closed = False

    def write(self, text: str) -> int:
        if not self._closed:
            try:
                return self._stream.write(text)  # type: ignore[attr-defined]
            except BrokenPipeError:
                self._close()
        return len(text)

    def flush(self) -> None:
        if not self._closed:
            try:
                self._stream.flush()  # type: ignore[attr-defined]
            except BrokenPipeError:
                self._close()

    def _close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())  # type: ignore[attr-defined]
            os.close(devnull)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _tolerate_closed_streams() -> Iterator[None]:
    # A reader that went away (`| head`) must not turn a finished verdict into an error: stdout and stderr both.
    originals = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _ClosedPipeSafe(originals[0]), _ClosedPipeSafe(originals[1])  # type: ignore[assignment]
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                stream.flush()
        sys.stdout, sys.stderr = originals
