# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The command line's supervisor: an exit code of 0 only for a verdict that was produced and written.

User code runs inside the command (plug-ins, factories, a weight sync, a checkpointing SPEC). The fence
(`rollout_consistency.fence`) turns its ``sys.exit`` into a usage error, but nothing inside a process can stop
``os._exit(0)`` or a kill. So the process the user started only supervises: [`run_supervised`] forks, the
child runs the command, and when the command has returned — its verdict decided and its reports written — the
child hands the exit code to the parent over a pipe. The parent exits with that code, or, when the child ended
without handing one over, with 2 (130 when it was interrupted) and one line saying how it ended and which call
into user code was running (the fence leaves a breadcrumb on the pipe at each call).

* Output streams straight from the child (it inherits stdout and stderr); the parent writes only its own
  error line.
* Ctrl-C and SIGTERM: the parent forwards SIGINT/SIGTERM to the child, which interrupts as before (exit 130,
  temporary files and Ray processes removed); a terminal's Ctrl-C reaches both, and the child treats a second
  signal within a second as the same one (`rollout_consistency.cli_guard`).
* Cost: one ``fork`` of a process that has imported only the command line (no torch): measured in
  docs/performance.md ("Command-line supervisor").
* Without ``os.fork`` (Windows) the command runs in this process, fenced but unsupervised.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Callable, Sequence

__all__ = ["enter_user_code", "exit_now", "is_channel", "leave_user_code", "run_supervised"]

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130

#: The write end of the pipe to the supervisor, in a supervised child only (None everywhere else: the parent,
#: an unsupervised process, a Ray worker).
_channel: list[int] = []


def enter_user_code(what: str) -> bool:
    """Leave a breadcrumb: a call into user code starts (True when a supervisor listens)."""
    return _send("enter\t" + what.replace("\n", " ")[:500])


def leave_user_code() -> None:
    """The call into user code that started last returned."""
    _send("leave")


def is_channel(info: os.stat_result) -> bool:
    """True when `info` (an ``os.stat`` result) is this child's pipe to its supervisor: never a report's target."""
    if not _channel:
        return False
    try:
        own = os.fstat(_channel[0])
    except OSError:
        return False
    return (own.st_dev, own.st_ino) == (info.st_dev, info.st_ino)


def _send(message: str) -> bool:
    if not _channel:
        return False
    with contextlib.suppress(OSError):  # a supervisor that went away cannot be told anything
        os.write(_channel[0], (message + "\n").encode("utf-8", "replace"))
    return True


def run_supervised(command: Callable[[list[str]], int], argv: Sequence[str], prog: str) -> int:
    """Run ``command(argv)`` in a child process; return the exit code it handed over (see the module docstring).

    Returns the code to exit with, in the parent. The child never returns from here: it raises
    ``SystemExit(code)`` once the code is handed over, so the caller's code after this call runs only in the
    parent (the child exits normally: ``finally`` blocks and ``atexit`` handlers run).
    """
    if not hasattr(os, "fork"):
        return command(list(argv))
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()  # nothing buffered may be written twice
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    child_pid: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        if os.getpid() != parent:  # the child, before its command installed its own handlers
            raise KeyboardInterrupt
        if child_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child_pid[0], signum)

    previous = {
        signum: signal.signal(signum, forward)
        for signum in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(signum) not in (signal.SIG_IGN, None)  # an ignored signal stays ignored
    }
    pid = os.fork()
    if pid == 0:  # the child: run the command, hand its code over
        os.close(read_fd)
        _channel.append(write_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        code = command(list(argv))
        _send(f"done\t{code}")
        raise SystemExit(code)
    child_pid.append(pid)
    os.close(write_fd)
    try:
        messages, status = _collect(read_fd, pid)
    finally:
        os.close(read_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return _decide(messages, status, prog)


def exit_now(code: int) -> None:
    """End the supervising parent with `code` at once: it ran no user code and holds nothing to clean up, and a
    second interpreter shutdown (the child already had one) costs 0.1-0.2 s of a short command."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code)


def _collect(read_fd: int, pid: int) -> tuple[list[str], int]:
    """Every line the child sent, and its wait status. A grandchild forked without exec may hold the pipe
    open after the child exited, so the child's exit is polled too."""
    buffer = b""
    status: int | None = None
    while True:
        ready, _, _ = select.select([read_fd], [], [], 0.2)
        if ready:
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            buffer += chunk
            continue
        done, status_ = os.waitpid(pid, os.WNOHANG)
        if done:
            status = status_
            break
    if status is None:
        _, status = os.waitpid(pid, 0)
    else:  # drain what the child wrote before it exited
        with contextlib.suppress(OSError):
            while select.select([read_fd], [], [], 0)[0]:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                buffer += chunk
    return buffer.decode("utf-8", "replace").splitlines(), status


def _decide(messages: list[str], status: int, prog: str) -> int:
    running: list[str] = []
    for line in messages:
        kind, _, rest = line.partition("\t")
        if kind == "done":
            with contextlib.suppress(ValueError):
                return int(rest)
        elif kind == "enter":
            running.append(rest)
        elif kind == "leave" and running:
            running.pop()
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGINT, signal.SIGTERM):
        _say(prog, "interrupted; no report was written (reports are written all at once at the end).")
        return EXIT_INTERRUPTED
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        how = f"was killed by signal {number} ({signal.Signals(number).name})"
        if number == signal.SIGKILL:
            how += ": out of memory, or killed from outside"
    else:
        how = f"exited with status {os.WEXITSTATUS(status)}"
    during = f" while running {running[-1]}" if running else ""
    cause = " (os._exit or a kill in user code?)" if running else ""
    _say(
        prog,
        f"the command ended before it produced a verdict: its process {how}{during}{cause}; this is not a PASS. "
        f"Let user code raise an exception instead of ending the process.",
    )
    return EXIT_USAGE


def _say(prog: str, message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
