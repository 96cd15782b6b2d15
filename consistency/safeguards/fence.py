# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A fence around every call into the user's code: it may fail, but it cannot end the run or hang it.

User code runs inside the checker's process — a plug-in module imported, its factory, its ``rollout`` and
``compute_log_prob`` calls, a ``--weight-sync`` function, a ``checkpointing`` SPEC and its ``--checkpoint``
function, a ``precision --spec`` factory. Such code can call ``sys.exit(0)`` (a training script that parses
its arguments at module level does), and exit 0 is what CI reads as PASS. Every such call runs as::

    with fenced("trainer_backend 'my_loop.py:make_trainer'", "the factory", timeout_s=config.user_code_timeout_s):
        trainer = factory(config=config)

* a ``SystemExit`` of any code raised inside becomes [`UserCodeExit`] naming the code and the call — a usage
  error (exit 2), never a PASS and never the FAIL code;
* with ``timeout_s``, a call still running after that many seconds is interrupted with [`UserCodeTimeout`]
  naming the setting that bounds it. The timer is ``SIGALRM`` (``setitimer``), so it applies on the main
  thread of a process whose ``SIGALRM`` is free (the command line's, a Ray actor's); elsewhere — another
  thread, or a test runner that holds ``SIGALRM`` itself (pytest-timeout) — the call runs unbounded in
  process. Under a supervisor (`rollout_consistency.safeguards.supervisor`: the command line, the pytest plugin's checks
  of user code) the bound is also enforced from outside: each call's breadcrumb carries it, and a call that
  ignores the timer — stuck in C code (a deadlocked collective), ``SIGALRM`` blocked or replaced — is killed
  with its process 2 s later (`supervisor.KILL_GRACE_S`) and reported the same way (exit 2 naming the call and the setting).

``KeyboardInterrupt`` passes through untouched (Ctrl-C still interrupts). Fences nest: the innermost names the
call, the outermost timer bounds the whole.
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType
from typing import Any

from rollout_consistency.safeguards import supervisor

__all__ = ["DEFAULT_TIMEOUT_S", "UserCodeError", "UserCodeExit", "UserCodeTimeout", "fenced"]

#: Default bound on one call into user code (`user_code_timeout_s`): loading a large checkpoint or one rollout
#: batch of a video model takes minutes, never an hour.
DEFAULT_TIMEOUT_S = 3600.0


class UserCodeError(Exception):
    """User code ended or overran a call it was given; a usage error (exit 2). The message names the call."""


class UserCodeExit(UserCodeError):
    """User code raised ``SystemExit`` (``sys.exit``, ``exit()``, argparse) inside a fenced call."""


class UserCodeTimeout(UserCodeError):
    """A fenced call into user code ran past its timeout."""


class _Deadline(BaseException):
    """Raised by the armed fence's timer: ``(timeout_s, setting)``. A BaseException, so that user code's
    ``except Exception:`` cannot swallow the interruption; the innermost fence turns it into UserCodeTimeout."""


class fenced:  # a context manager, named like one (as contextlib.suppress)
    """Context manager fencing one call into user code (see the module docstring).

    Args:
        owner: who the code belongs to, e.g. ``"rollout_backend 'my_loop.py:make_rollout'"``.
        call: which call, e.g. ``"the factory"``, ``"rollout(request) on batch 0"``, ``"import"``.
        timeout_s: bound in seconds (``None``: unbounded).
        setting: the name of the setting that holds `timeout_s`, for the message.
    """

    def __init__(
        self, owner: str, call: str, *, timeout_s: float | None = None, setting: str = "user_code_timeout_s"
    ) -> None:
        self.owner, self.call, self.timeout_s, self.setting = owner, call, timeout_s, setting
        self._armed = False
        self._previous: Any = None
        self._breadcrumb = False

    def __enter__(self) -> fenced:
        self._breadcrumb = supervisor.enter_user_code(f"{self.owner}: {self.call}", self.timeout_s, self.setting)
        if self.timeout_s is not None and _alarm_is_free():
            self._previous = signal.signal(signal.SIGALRM, self._on_alarm)
            self._armed = True
            signal.setitimer(signal.ITIMER_REAL, self.timeout_s)
        return self

    def _on_alarm(self, _signum: int, _frame: Any) -> None:
        if self._armed:
            self._armed = False
            raise _Deadline(self.timeout_s, self.setting)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        was_armed = self._previous is not None
        self._armed = False
        if was_armed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)
            self._previous = None
        if self._breadcrumb:
            supervisor.leave_user_code()
        if isinstance(exc, _Deadline):
            timeout_s, setting = exc.args
            raise UserCodeTimeout(
                f"{self.owner}: {self.call} did not return within {timeout_s:g} s ({setting}); fix the hang, or "
                f"raise {setting} if the call is legitimately that slow."
            ) from None
        if exc_type is not None and issubclass(exc_type, SystemExit):
            code = exc.code if isinstance(exc, SystemExit) else None
            raise UserCodeExit(
                f"{self.owner}: {self.call} raised SystemExit({code!r}) — user code may not end the check (exit 0 "
                f"would read as PASS); {_exit_hint(self.call)}"
            ) from None
        return False


def _exit_hint(call: str) -> str:
    if call.startswith("import"):
        return (
            "code at the module's top level ends the process (argparse or sys.exit at import?): move it under "
            "`if __name__ == '__main__':`."
        )
    return "raise an exception instead of calling sys.exit()/exit() in this function."


def _alarm_is_free() -> bool:
    # setitimer/signal work on the main thread only; a SIGALRM handler someone else installed is theirs.
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        return False
    return signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None)
