# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""rollout-consistency: keep the rollout and the trainer of diffusion RL computing the same log-probabilities.

The package (docs/design.md)::

    rollout_consistency.gate         the step-1 gate: config, sides (plan, backends, plug-ins), judging (metrics, verdict, report), diagnosis, tables
    rollout_consistency.training     training tools: gradient-checkpointing check, NaN capture, RNG state, precision
    rollout_consistency.adapters     rollout and trainer adapters (Qwen-Image, SD3, FLUX; diffusers, vLLM-omni)
    rollout_consistency.schedulers   the patched FlowMatch SDE scheduler and SDE windows
    rollout_consistency.lint         the static lint
    rollout_consistency.cli          `rollout-consistency` / `python -m rollout_consistency` (sub-commands in `commands`)

The step-1 check in five names (docs/checker.md)::

    from rollout_consistency import CheckConfig, run_step1_check

    report = run_step1_check(CheckConfig(model_family="qwen-image", profile="exact"))
    print(report.format_table())
    assert report.passed, report.reasons

Importing `rollout_consistency` imports nothing else of ours, nor numpy, torch or diffusers: every name is
loaded on first use (`rollout_consistency.safeguards.fence`, the lint and the command line pay only for what they import).
"""

from __future__ import annotations

import importlib
import importlib.util
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("rollout-consistency")
except PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["CheckConfig", "ConfigError", "Report", "__version__", "gate", "load_config", "run_step1_check", "training"]

# name -> the module that holds it, imported on first use (the gate loads numpy; `training`, torch).
_LAZY = {
    "CheckConfig": "rollout_consistency.gate.config",
    "ConfigError": "rollout_consistency.gate.config",
    "load_config": "rollout_consistency.gate.config",
    "Report": "rollout_consistency.gate.judging.report",
    "run_step1_check": "rollout_consistency.gate.check",
}
_SUBPACKAGES = ("gate", "training")
# Names 0.1.0 exported from the root; still served (not part of `__all__`) so code written for 0.1.0 keeps
# running: every name of `rollout_consistency.gate.__all__`, and these. New code imports them from
# `rollout_consistency.gate` / `rollout_consistency.training`.
_MOVED_TO_TRAINING = (
    "checkpoint",
    "NanCapture",
    "replay",
    "load_capture",
    "audit_precision",
    "diff_precision_reports",
    "PrecisionReport",
)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _SUBPACKAGES or (not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}")):
        # a module of ours (`from rollout_consistency import lint` asks here first): that module alone
        return importlib.import_module(f"{__name__}.{name}")
    if name in _MOVED_TO_TRAINING:
        return getattr(importlib.import_module(f"{__name__}.training"), name)
    if not name.startswith("__"):  # dunder probes (copy, pickle, inspect) must not load the gate
        gate = importlib.import_module(f"{__name__}.gate")
        if name in gate.__all__:
            return getattr(gate, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
