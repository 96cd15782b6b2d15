# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What protects the user's process and files from the checker and from the user's own code.

    fence            every call into user code: ``sys.exit`` and exceptions become one-line errors, deadlines
    supervisor       the command line's supervisor: exit 0 only for a verdict produced and written; kills from outside
    supervised_call  one call of user code in a fresh interpreter under the supervisor (the pytest plugin's checks)
    cli_guard        one exit code per outcome, never a traceback
    paths            input paths refused before anything is read (FIFOs, devices, directories, huge files)
    output_paths     output paths resolved and checked once, when a command starts
    atomic_write     all-or-nothing report files
    memory_budget    how much memory this process may still take, checked before a large input is loaded
    object_spec      loading a ``module:attribute`` or ``file.py:attribute`` spec

Each module imports nothing of ours but this folder's modules (``supervised_call`` sits with the entry points'
layer: it runs the supervisor), so every layer may use them. Importing this package loads none of them: each is imported on first use.
"""

from __future__ import annotations

from rollout_consistency.base.lazy_face import lazy_face

__all__ = [
    "atomic_write",
    "cli_guard",
    "fence",
    "memory_budget",
    "object_spec",
    "output_paths",
    "paths",
    "supervised_call",
    "supervisor",
]

# Every name is one of this folder's modules, imported on first use (`base.lazy_face`, which imports nothing of ours).
__getattr__, __dir__ = lazy_face(__name__, {})
