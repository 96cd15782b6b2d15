# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Process-level details of the command line: the installed version, and a reader that closes the pipe early.

Kept out of cli.py so the command table stays about commands."""

from __future__ import annotations

import os
import sys
from importlib import metadata

__all__ = ["EXIT_BROKEN_PIPE", "installed_version", "quiet_broken_pipe"]

# What a shell reports for a process killed by SIGPIPE (128 + 13): `cmd | head` callers expect it.
EXIT_BROKEN_PIPE = 141


def installed_version() -> str:
    """The installed distribution's version (`rollout-consistency --version`); "unknown" when run from a bare tree."""
    try:
        return metadata.version("rollout-consistency")
    except metadata.PackageNotFoundError:
        return "unknown"


def quiet_broken_pipe() -> int:
    """After a BrokenPipeError on stdout (`... --help | head`): point stdout at /dev/null so the interpreter's
    final flush cannot raise a second time, and return the SIGPIPE exit code. No traceback, no message: the
    reader chose to stop reading."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass
    return EXIT_BROKEN_PIPE
