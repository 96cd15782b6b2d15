# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The command line's supervisor: an exit code of 0 only for a verdict that was produced and written.

User code runs inside the command (plug-ins, factories, a weight sync, a checkpointing SPEC). The fence
(`rollout_consistency.safeguards.fence`) turns its ``sys.exit`` into a usage error, but nothing inside a process can stop
``os._exit(0)``, a kill, or a call stuck in C code. So the process the user started only supervises:
[`run_supervised`] forks, the child runs the command, and when the command has returned — its verdict decided
and its reports written — the child hands the exit code to the parent over a pipe. The parent exits with that
code, or, when the child ended without handing one over, with 2 (130 when it was interrupted) and one line saying
how it ended and which call into user code was running (the fence leaves a breadcrumb on the pipe at each call).

* **Timeouts from outside.** Each breadcrumb carries the call's bound (``user_code_timeout_s``). The fence's own
  timer (``SIGALRM``) interrupts a call that returns to Python; one that does not — blocked in C code (a stuck
  collective), or with ``SIGALRM`` blocked or replaced — is stopped by the parent [`KILL_GRACE_S`] after its
  bound: the child and every process it started are killed, and the parent exits 2 naming the call and the
  setting.
* **The verdict, then nothing.** Once the code is handed over, the child has [`HANDOVER_GRACE_S`] to join its
  threads and run its ``atexit`` handlers, and [`FINALIZE_GRACE_S`] more for the interpreter's own shutdown
  (seconds, with torch and diffusers loaded); an ``atexit`` handler or a non-daemon thread of user code that
  holds it longer is killed, and the parent exits with the handed-over code (and says so on stderr).
* **Temporary files.** The child announces each temporary file or directory it creates ([`announce_temp`]: the
  report writer's, the local Ray cluster's); whatever of them is left when the child ends — killed (SIGKILL, the
  out-of-memory killer) or hung up — the parent removes.
* Output streams straight from the child (it inherits stdout and stderr); the parent writes only its own lines.
* Ctrl-C, SIGTERM and SIGHUP: the parent forwards them to the child, which interrupts as before (exit 130,
  temporary files and Ray processes removed); a terminal's Ctrl-C reaches both, and the child treats a second
  signal within a second as the same one (`rollout_consistency.safeguards.cli_guard`).
* **Forking only where it is safe.** A process that runs other threads cannot be forked safely: a lock another
  thread held at the fork stays held in the child, and torch's OpenMP pool hangs the child's first parallel
  operation (the child deadlocked when `main()` was called from such a process). There [`run_supervised`] starts
  the same command in a fresh interpreter instead (`respawn`), which supervises itself, and waits for its code.
* Cost: one ``fork`` of a process that has imported only the command line (no torch): measured in
  docs/performance.md ("Command-line supervisor").
* Without ``os.fork`` (Windows) the command runs in this process, fenced but unsupervised.

`rollout_consistency.safeguards.supervised_call` runs one function call the same way, in a fresh interpreter (the pytest
plugin's checks of user code).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FINALIZE_GRACE_S",
    "HANDOVER_GRACE_S",
    "KILL_GRACE_S",
    "announce_temp",
    "enter_user_code",
    "exit_now",
    "fork_hazard",
    "is_channel",
    "leave_user_code",
    "run_supervised",
]

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130

#: Seconds past a call's bound before the parent kills the child: the fence's own timer interrupts a call that
#: returns to Python within milliseconds, and then cleans up (Ray processes, temporary files) itself.
KILL_GRACE_S = 2.0
#: Seconds the child may take, after handing its code over, to join its threads and run its atexit handlers (ours
#: take milliseconds; user code's may block for ever).
HANDOVER_GRACE_S = 5.0
#: Seconds the interpreter's own shutdown may take after the last atexit handler: tearing down torch and diffusers
#: took 2-6 s on a loaded 2-core machine.
FINALIZE_GRACE_S = 60.0

#: The signals forwarded to the child; the child interrupts on each (exit 130).
_FORWARDED = (signal.SIGINT, signal.SIGTERM, *((signal.SIGHUP,) if hasattr(signal, "SIGHUP") else ()))
#: Only files and directories named like ours are removed for the child (the report writer's ``.rc-tmp-*``,
#: the local Ray cluster's ``rc-ray-*``).
_OWN_TEMP_PREFIXES = (".rc-", "rc-")

#: The write end of the pipe to the supervisor, in a supervised child only (None everywhere else: the parent,
#: an unsupervised process, a Ray worker).
_channel: list[int] = []


def enter_user_code(what: str, timeout_s: float | None = None, setting: str = "user_code_timeout_s") -> bool:
    """Leave a breadcrumb: a call into user code starts, bounded by `timeout_s` (the value of `setting`), or
    unbounded (None). True when a supervisor listens (it then enforces the bound from outside)."""
    bound = "" if timeout_s is None else repr(float(timeout_s))
    return _send(f"enter\t{bound}\t{setting}\t" + what.replace("\n", " ").replace("\t", " ")[:500])


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


def announce_temp(path: str | os.PathLike[str]) -> None:
    """A temporary file or directory this process just created and will remove (or rename) itself: the
    supervisor removes it if the process ends first. Named ``.rc-*`` or ``rc-*``; anything else is left alone."""
    _send("temp\t" + os.path.abspath(os.fspath(path)))


def _send(message: str) -> bool:
    if not _channel:
        return False
    with contextlib.suppress(OSError):  # a supervisor that went away cannot be told anything
        os.write(_channel[0], (message + "\n").encode("utf-8", "replace"))
    return True


def fork_hazard() -> str | None:
    """Why forking this process is unsafe (other threads run, or torch is loaded), or None when it is safe."""
    threads = threading.active_count()
    if threads > 1:
        return f"this process runs {threads} threads"
    if "torch" in sys.modules:
        return "this process has imported torch (its OpenMP threads do not survive a fork)"
    return None


def run_supervised(
    command: Callable[[list[str]], int],
    argv: Sequence[str],
    prog: str,
    *,
    respawn: Sequence[str] | None = None,
) -> int:
    """Run ``command(argv)`` in a child process; return the exit code it handed over (see the module docstring).

    Args:
        command: the command; returns its exit code.
        argv: its arguments.
        prog: the program name for the supervisor's own lines.
        respawn: the command line (``[sys.executable, ...]``) that runs the same command in a fresh interpreter,
            used when this process cannot be forked safely ([`fork_hazard`]); without it such a process is
            refused (exit 2, one line).

    Returns the code to exit with, in the parent. The child never returns from here: it raises
    ``SystemExit(code)`` once the code is handed over, so the caller's code after this call runs only in the
    parent (the child exits normally: ``finally`` blocks and ``atexit`` handlers run, within the graces above).
    """
    if not hasattr(os, "fork"):
        return command(list(argv))
    hazard = fork_hazard()
    if hazard is not None:
        if respawn is None:
            _say(
                prog, f"{hazard}, so the command cannot run supervised here; call it with argv to run in this process."
            )
            return EXIT_USAGE
        return _run_respawned(list(respawn), prog)
    _flush_streams()  # nothing buffered may be written twice
    read_fd, write_fd = os.pipe()
    child: list[int] = []
    with _forwarding(child) as replaced:
        pid = os.fork()
        if pid == 0:  # the child: run the command, hand its code over
            os.close(read_fd)
            _channel.append(write_fd)
            for signum, handler in replaced.items():
                signal.signal(signum, handler)
            # Registered before any user code's, so it runs last: the threads are joined and every other atexit
            # handler has returned; only the interpreter's own shutdown is left.
            atexit.register(_send, "finalizing")
            code = command(list(argv))
            _flush_streams()  # the verdict's output is out before the parent may stop this process
            _send(f"done\t{code}")
            raise SystemExit(code)
        child.append(pid)
        os.close(write_fd)
        try:
            watched = _watch(read_fd, pid)
        finally:
            os.close(read_fd)
    _remove_temps(watched.temps)
    return _decide(watched, prog)


@contextlib.contextmanager
def _forwarding(child: list[int]) -> Iterator[dict[int, Any]]:
    """Forward SIGINT/SIGTERM/SIGHUP to the process in `child` (once it is there) while the block runs; yields the
    handlers it replaced. An ignored signal stays ignored; signal handlers can only be set on the main thread."""
    parent = os.getpid()

    def forward(signum: int, _frame: object) -> None:
        if os.getpid() != parent:  # a forked child, before its command installed its own handlers
            raise KeyboardInterrupt
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], signum)

    replaced: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in _FORWARDED:
            if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                replaced[signum] = signal.signal(signum, forward)
    try:
        yield replaced
    finally:
        if os.getpid() == parent:
            for signum, handler in replaced.items():
                signal.signal(signum, handler)


def _run_respawned(argv: list[str], prog: str) -> int:
    """Run `argv` (a fresh interpreter running the same supervised command) and map how it ended to a code."""
    _flush_streams()
    child: list[int] = []
    with _forwarding(child):
        proc = subprocess.Popen(argv)
        child.append(proc.pid)
        status = proc.wait()
    if status >= 0:
        return status
    if -status in _FORWARDED:
        _say(prog, "interrupted; no report was written (reports are written all at once at the end).")
        return EXIT_INTERRUPTED
    _say(
        prog,
        f"the command's process was killed by signal {-status} ({signal.Signals(-status).name}); this is not a PASS.",
    )
    return EXIT_USAGE


def exit_now(code: int) -> None:
    """End the supervising parent with `code` at once: it ran no user code and holds nothing to clean up, and a
    second interpreter shutdown (the child already had one) costs 0.1-0.2 s of a short command."""
    _flush_streams()
    os._exit(code)


def _flush_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()


@dataclass(frozen=True)
class _Call:
    """A call into user code the child is inside: what it is, its bound and when the parent heard of it."""

    what: str
    timeout_s: float | None
    setting: str
    started: float

    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.started + self.timeout_s + KILL_GRACE_S


@dataclass(frozen=True)
class _Watched:
    """How the child ended: its wait status, the code it handed over (None: none), the calls it was inside, the
    call whose bound it overran (the parent killed it), whether it was killed after the handover, and the
    temporary paths it announced."""

    status: int
    code: int | None
    running: tuple[_Call, ...]
    overran: _Call | None
    held_after_handover: bool
    temps: tuple[str, ...]


class _Listener:
    """What the child said so far: the calls it is inside, the code it handed over (and when), its temporary paths."""

    def __init__(self) -> None:
        self.pending = b""
        self.running: list[_Call] = []
        self.code: int | None = None
        self.handed_at = 0.0
        self.finalizing_at: float | None = None
        self.temps: list[str] = []

    def feed(self, chunk: bytes, *, final: bool = False) -> None:
        self.pending += chunk
        *lines, self.pending = self.pending.split(b"\n")
        if final:
            lines.append(self.pending)
        for line in lines:
            kind, _, rest = line.decode("utf-8", "replace").partition("\t")
            if kind == "done" and self.code is None:
                with contextlib.suppress(ValueError):
                    self.code, self.handed_at = int(rest), time.monotonic()
            elif kind == "enter":
                bound, setting, what = [*rest.split("\t", 2), "", ""][:3]
                with contextlib.suppress(ValueError):
                    self.running.append(_Call(what, float(bound) if bound else None, setting, time.monotonic()))
            elif kind == "finalizing":
                self.finalizing_at = time.monotonic()
            elif kind == "leave" and self.running:
                self.running.pop()
            elif kind == "temp":
                self.temps.append(rest)


def _watch(read_fd: int, pid: int) -> _Watched:
    """Read the child's messages and enforce the bounds until it has exited. A grandchild forked without exec may
    hold the pipe open after the child exited (and a child may close the pipe early), so the child's exit is
    polled too."""
    heard = _Listener()
    overran: _Call | None = None
    held, open_ = False, True
    while True:
        now = time.monotonic()
        if overran is None and not held:
            if heard.code is not None and now > _exit_deadline(heard):
                held = True
                _kill_tree(pid)
            late = _overrun(heard.running, now)
            if heard.code is None and late is not None:
                overran = late
                _kill_tree(pid)
        if open_ and select.select([read_fd], [], [], 0.1)[0]:
            chunk = _read(read_fd)
            open_ = bool(chunk)
            heard.feed(chunk)
            continue
        done, status = os.waitpid(pid, os.WNOHANG)
        if not done and not open_:
            time.sleep(0.01)  # the pipe closed before the child exited: poll its exit (normally milliseconds)
        if done:
            while open_ and select.select([read_fd], [], [], 0)[0]:  # what the child wrote just before it exited
                chunk = _read(read_fd)
                open_ = bool(chunk)
                heard.feed(chunk)
            heard.feed(b"", final=True)
            return _Watched(status, heard.code, tuple(heard.running), overran, held, tuple(heard.temps))


def _exit_deadline(heard: _Listener) -> float:
    """When a child that handed its code over is stopped: its threads and atexit handlers get HANDOVER_GRACE_S, the
    interpreter's shutdown after them FINALIZE_GRACE_S."""
    if heard.finalizing_at is not None:
        return heard.finalizing_at + FINALIZE_GRACE_S
    return heard.handed_at + HANDOVER_GRACE_S


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def _overrun(running: list[_Call], now: float) -> _Call | None:
    """The call to report when an open call's deadline has passed: named like the fence names it (the innermost
    call), with the bound that ran out (the earliest deadline bounds all the calls inside it)."""
    late = [call for call in running if (call.deadline() or now) < now]
    if not late:
        return None
    bound = min(late, key=lambda call: call.deadline() or now)
    return _Call(running[-1].what, bound.timeout_s, bound.setting, bound.started)


def _kill_tree(pid: int) -> None:
    """SIGKILL the child and every process it started (Ray's, a user's pool): none may hold the command."""
    family = _descendants(pid)
    for member in (pid, *family):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    ppid = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _remove_temps(paths: Sequence[str]) -> None:
    for path in paths:
        if not os.path.basename(path).startswith(_OWN_TEMP_PREFIXES):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _decide(watched: _Watched, prog: str) -> int:
    status = watched.status
    if watched.code is not None:
        if watched.held_after_handover:
            _say(
                prog,
                "the command's process did not exit after handing over its verdict (an atexit handler or a non-daemon "
                "thread of user code held it); it was stopped. The exit code is the verdict's.",
                kind="note",
            )
        return watched.code
    if watched.overran is not None:
        call = watched.overran
        _say(
            prog,
            f"{call.what} did not return within {call.timeout_s:g} s ({call.setting}); the supervisor stopped it "
            f"(blocked in C code, or SIGALRM blocked or replaced). Fix the hang, or raise {call.setting} if the call "
            f"is legitimately that slow.",
        )
        return EXIT_USAGE
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in _FORWARDED:
        _say(prog, "interrupted; no report was written (reports are written all at once at the end).")
        return EXIT_INTERRUPTED
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        how = f"was killed by signal {number} ({signal.Signals(number).name})"
        if number == signal.SIGKILL:
            how += ": out of memory, or killed from outside"
    else:
        how = f"exited with status {os.WEXITSTATUS(status)}"
    running = watched.running
    during = f" while running {running[-1].what}" if running else ""
    cause = " (os._exit or a kill in user code?)" if running else ""
    _say(
        prog,
        f"the command ended before it produced a verdict: its process {how}{during}{cause}; this is not a PASS. "
        f"Let user code raise an exception instead of ending the process.",
    )
    return EXIT_USAGE


def _say(prog: str, message: str, kind: str = "error") -> None:
    with contextlib.suppress(OSError, ValueError):
        print(f"{prog}: {kind}: {message}", file=sys.stderr, flush=True)
