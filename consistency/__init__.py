# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""rollout-consistency: the step-1 gate and the training-consistency tools.

Two subpackages: `rollout_consistency.gate` (the step-1 check: config, metrics, tolerances, verdict, report)
and `rollout_consistency.training` (checkpointing, NaN capture, RNG state, precision audit); the gate's
main names are re-exported here. `rollout_consistency.adapters` and `rollout_consistency.schedulers` hold
the rollout/trainer adapters and the patched scheduler.

Step-1 check (docs/checker.md)::

    from rollout_consistency import CheckConfig, run_step1_check

    report = run_step1_check(CheckConfig(model_family="qwen-image", profile="exact"))
    print(report.format_table())
    assert report.passed, report.reasons

    run_step1_check(config)          -> Report     the API the CLI, scripts/step1_check.py and the pytest plugin call
    CheckConfig, load_config, ConfigError          settings (names as in Flow-GRPO / verl / vLLM-omni)
    Report, Verdict, ConsistencyMetrics, MetricValues, Tolerance
    compute_metrics, decide, resolve_tolerance     the pieces, for a trainer that has both log-prob tables

Training tools (docs/training-consistency.md), imported on first use (they import torch):
    check_checkpointing, checkpoint                gradient-checkpointing check (RNG replay in backward)
    NanCapture, replay, load_capture               NaN/Inf capture and replay
    audit_precision, diff_precision_reports        precision-policy audit

Importing `rollout_consistency` imports neither torch nor diffusers.
"""

from __future__ import annotations

import importlib
from typing import Any

from .gate.check import USAGE_ERRORS, injection_settings, run_step1_check
from .gate.config import CheckConfig, ConfigError, load_config
from .gate.metrics import METRIC_NAMES, ConsistencyMetrics, MetricValues, compute_metrics
from .gate.report import Report, SampleInfo
from .gate.tolerances import PROFILES, Tolerance, resolve_tolerance
from .gate.verdict import CheckResult, Problem, Verdict, decide

# name -> module of the training tools, loaded lazily (torch-heavy).
_LAZY = {
    "check_checkpointing": "rollout_consistency.training.checkpoint_check",
    "CheckpointingReport": "rollout_consistency.training.checkpoint_check",
    "checkpoint": "rollout_consistency.training.checkpointing",
    "NanCapture": "rollout_consistency.training.nan_capture",
    "replay": "rollout_consistency.training.nan_capture",
    "load_capture": "rollout_consistency.training.nan_capture",
    "audit_precision": "rollout_consistency.training.precision",
    "diff_precision_reports": "rollout_consistency.training.precision",
    "PrecisionReport": "rollout_consistency.training.precision",
}

__all__ = [
    "METRIC_NAMES",
    "PROFILES",
    "USAGE_ERRORS",
    "CheckConfig",
    "CheckResult",
    "ConfigError",
    "ConsistencyMetrics",
    "MetricValues",
    "Problem",
    "Report",
    "SampleInfo",
    "Tolerance",
    "Verdict",
    "compute_metrics",
    "decide",
    "injection_settings",
    "load_config",
    "resolve_tolerance",
    "run_step1_check",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
