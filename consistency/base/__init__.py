# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The facts every layer reads, importing nothing of ours (and not torch).

    registry          `Registry`: entries known by name, the mechanism behind every extension point
    builtin_families  `BUILTIN_FAMILIES`: one record per built-in model family, the table the gate and adapters read
    sampling_rules    what a rollout's sampling settings must be, checked in one place

Importing this package loads none of them: each is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["builtin_families", "registry", "sampling_rules"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
