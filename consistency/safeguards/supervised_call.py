# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""One function call that runs user code, supervised in a fresh interpreter: the pytest plugin's checks.

Inside a pytest session a plug-in's ``os._exit(0)`` would end the session with exit 0 — a green CI job with
nothing checked — and a call stuck in C code would hang it. [`call_supervised`] runs ``function(*args)`` in a
fresh interpreter under the command line's supervisor (`rollout_consistency.safeguards.supervisor`: the bounds enforced from
outside, the verdict handed over, temporary files removed) and returns its result; an error, an early end or a
hang of user code comes back as a [`SupervisedCallError`] with its one line.

A fresh interpreter, not a fork of the session: a pytest session has usually imported torch already, whose
OpenMP threads hang a forked child. It costs one interpreter start-up and the imports of the call (docs/ci.md).
The function, its arguments and its result travel by pickle (module-level functions, picklable values).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from rollout_consistency.safeguards.cli_guard import EXIT_USAGE, guarded
from rollout_consistency.safeguards.supervisor import exit_now, run_supervised

__all__ = ["SupervisedCallError", "call_supervised", "serve_call"]

_ENTRY = "from rollout_consistency.safeguards.supervised_call import serve_call; serve_call()"


class SupervisedCallError(RuntimeError):
    """A supervised call ended without a result. ``code``: its exit code (2 an error, 130 interrupted); the
    message: its one line (the error the call raised, or how user code ended or hung the process)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def call_supervised(function: Callable[..., Any], *args: Any, prog: str) -> Any:
    """``function(*args)`` run supervised in a fresh interpreter; returns its result.

    Args:
        function: a module-level function (pickled by reference).
        args: its arguments (picklable).
        prog: the name on the error lines.

    The child's stdout is the caller's; its stderr is passed on to ``sys.stderr`` once it ended.

    Raises:
        SupervisedCallError: the call raised (its one-line error), user code ended the process or overran its
            bound, or the call was interrupted.
    """
    directory = tempfile.mkdtemp(prefix="rc-call-")
    try:
        with open(os.path.join(directory, "call.pickle"), "wb") as handle:
            pickle.dump((function, args), handle)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        done = subprocess.run([sys.executable, "-c", _ENTRY, directory, prog], stderr=subprocess.PIPE, check=False)
        err = done.stderr.decode("utf-8", "replace")
        with contextlib.suppress(OSError, ValueError):
            sys.stderr.write(err)
        result = os.path.join(directory, "result.pickle")
        if done.returncode == 0 and os.path.exists(result):
            with open(result, "rb") as handle:
                return pickle.load(handle)
        lines = [line for line in err.splitlines() if line.strip()]
        code = done.returncode if done.returncode > 0 else EXIT_USAGE
        raise SupervisedCallError(lines[-1] if lines else f"the call ended with status {done.returncode}", code)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def serve_call() -> None:
    """The fresh interpreter's side: ``python -c ... DIRECTORY PROG``. Does not return."""
    directory, prog = sys.argv[1], sys.argv[2]
    exit_now(run_supervised(lambda argv: guarded(_serve, argv, prog), [directory], prog))


def _serve(argv: list[str]) -> int:
    with open(os.path.join(argv[0], "call.pickle"), "rb") as handle:
        function, args = pickle.load(handle)
    result = function(*args)
    temporary = os.path.join(argv[0], "result.pickle.part")
    with open(temporary, "wb") as handle:
        pickle.dump(result, handle)
    os.replace(temporary, os.path.join(argv[0], "result.pickle"))
    return 0
