# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A package face that imports each public name's module on first use (PEP 562's module ``__getattr__``), so that
importing one module deep in a package loads none of its siblings: the faces of `rollout_consistency` (the root), `rollout_consistency.base`,
`rollout_consistency.safeguards`, `rollout_consistency.gate`, `rollout_consistency.gate.tables` and
`rollout_consistency.gate.monitor` use it. It imports nothing of ours, so every layer may."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_face"]


def lazy_face(
    package: str, served_by: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for `package`'s ``__init__``: each name of `served_by` (a module under
    `package` -> the names it serves) comes from its module, imported on first use; any other public name that is
    a module of `package` is that module (as when the face imported them all); anything else, AttributeError."""
    lazy = {name: module for module, names in served_by.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name in lazy:
            return getattr(importlib.import_module(f"{package}.{lazy[name]}"), name)
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}"):
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *lazy})

    return __getattr__, __dir__
