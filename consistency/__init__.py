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

Importing `rollout_consistency` imports neither torch nor diffusers (`training` is loaded on first use).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from . import gate
from .gate.check import run_step1_check
from .gate.config import CheckConfig, ConfigError, load_config
from .gate.judging.report import Report

try:
    __version__ = version("rollout-consistency")
except PackageNotFoundError:  # imported from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["CheckConfig", "ConfigError", "Report", "__version__", "gate", "load_config", "run_step1_check", "training"]

# Names 0.1.0 exported from the root; still served (not part of `__all__`) so code written for 0.1.0 keeps
# running. New code imports them from `rollout_consistency.gate` / `rollout_consistency.training`.
_MOVED = {
    **dict.fromkeys(gate.__all__, "rollout_consistency.gate"),
    **dict.fromkeys(
        (
            "checkpoint",
            "NanCapture",
            "replay",
            "load_capture",
            "audit_precision",
            "diff_precision_reports",
            "PrecisionReport",
        ),
        "rollout_consistency.training",
    ),
}


def __getattr__(name: str) -> Any:
    if name == "training":  # torch-heavy on first attribute use only, but the package itself is cheap
        return importlib.import_module("rollout_consistency.training")
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
