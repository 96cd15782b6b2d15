# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Your own tables: gate the log-prob tables your rollout and your trainer computed, with the check's metrics,
verdict and doctor (docs/ci.md).

    api              `gate(rollout_log_probs, trainer_log_probs, settings)` -> `GateReport`
    settings         `GateSettings`: how `gate()` judges the tables (profile, clip ranges, limits, ...)
    dump             `write_dump` / `read_dump`: the tables as one safetensors file (`rollout-consistency gate DUMP`)
    recorder         `Step1Recorder`: collects the tables inside a training loop, gates them at the first update;
                     `digest_ids`: sample ids for a loop that keeps none
    coverage         what the recorder recorded against what the rollout produced (in its report and its dump)
    pytest_fixtures  the ``step1_gate`` fixture and marker (loaded by the pytest plugin; it imports pytest, so
                     this package does not import it)

Importing this package imports none of its modules: each name loads its module on first use (the pytest plugin
imports the fixtures module alone).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

# The module (under this package) that serves each name, imported on first use.
_SERVED_BY: dict[str, tuple[str, ...]] = {
    "api": ("GateInputError", "GateReport", "gate"),
    "dump": ("DumpFormatError", "LogProbDump", "read_dump", "write_dump"),
    "recorder": ("RecorderError", "Step1GateFailed", "Step1Recorder", "digest_ids"),
    "settings": ("GateSettings",),
}
_LAZY = {name: module for module, names in _SERVED_BY.items() for name in names}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        return importlib.import_module(f"{__name__}.{name}")  # a module of this package, as when all were loaded
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
