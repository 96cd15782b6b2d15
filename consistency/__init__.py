# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The step-1 consistency checker and the training-consistency tools.

Step-1 check (docs/checker.md)::

    from rollout_consistency import CheckConfig, run_step1_check

    report = run_step1_check(CheckConfig(model_family="qwen-image", profile="exact"))
    print(report.format_table())
    assert report.passed, report.reasons

    run_step1_check(config)          -> Report     the API the CLI, scripts/step1_check.py and the pytest plugin call
    CheckConfig, load_config, ConfigError          settings (names as in Flow-GRPO / verl / vLLM-omni)
    Report, Verdict, ConsistencyMetrics, MetricValues, Tolerance
    compute_metrics, decide, resolve_tolerance     the pieces, for a trainer that has both log-prob tables
    gate(rollout, trainer, ...) -> GateReport      your own two tables -> verdict (docs/ci.md)
    write_dump, read_dump                          the versioned log-prob dump (`rollout-consistency gate DUMP`)
    Step1Recorder                                  records your training loop's first update and gates it

Training tools (docs/training-consistency.md), imported on first use (they import torch):
    check_recompute_consistency, checkpoint        gradient-checkpointing recompute check
    NanCapture, replay, load_capture               NaN/Inf capture and replay
    audit_precision, diff_precision_reports        precision-policy audit

Importing `consistency` imports neither torch nor diffusers.
"""

from __future__ import annotations

import importlib
from typing import Any

from .check import USAGE_ERRORS, injection_settings, run_step1_check
from .config import CheckConfig, ConfigError, load_config
from .dump import DumpFormatError, LogProbDump, read_dump, write_dump
from .gate_api import GateInputError, GateReport, gate
from .metrics import METRIC_NAMES, ConsistencyMetrics, MetricValues, compute_metrics
from .mismatch import MismatchStats, compute_mismatch
from .recorder import RecorderError, Step1GateFailed, Step1Recorder
from .report import Report, SampleInfo
from .tolerances import PROFILES, Tolerance, resolve_tolerance
from .verdict import CheckResult, Problem, Verdict, decide

# name -> module of the training tools, loaded lazily (torch-heavy).
_LAZY = {
    "check_recompute_consistency": "rollout_consistency.recompute",
    "RecomputeReport": "rollout_consistency.recompute",
    "checkpoint": "rollout_consistency.checkpointing",
    "NanCapture": "rollout_consistency.nan_capture",
    "replay": "rollout_consistency.nan_capture",
    "load_capture": "rollout_consistency.nan_capture",
    "audit_precision": "rollout_consistency.precision",
    "diff_precision_reports": "rollout_consistency.precision",
    "PrecisionReport": "rollout_consistency.precision",
}

__all__ = [
    "METRIC_NAMES",
    "PROFILES",
    "USAGE_ERRORS",
    "CheckConfig",
    "CheckResult",
    "ConfigError",
    "ConsistencyMetrics",
    "DumpFormatError",
    "GateInputError",
    "GateReport",
    "LogProbDump",
    "MismatchStats",
    "RecorderError",
    "Step1GateFailed",
    "Step1Recorder",
    "MetricValues",
    "Problem",
    "Report",
    "SampleInfo",
    "Tolerance",
    "Verdict",
    "compute_metrics",
    "compute_mismatch",
    "gate",
    "read_dump",
    "write_dump",
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
