# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The step-1 gate: do the rollout and the trainer compute the same log-probabilities before the first update?

Data flows one way, each arrow a plain function call (or a Ray call over the same function)::

    CheckConfig ─ make_plan ─▶ rollout backend ─▶ float32 Trajectory ─▶ trainer backend ─▶ log-probs
                                                        compute_metrics ─▶ decide ─▶ Report

Modules: `config` (settings, files, aliases), `plan` (prompts, seeds, SDE windows, batches), `backends`
(the built-in rollout and trainer backends), `metrics`, `tolerances` (profiles), `verdict`, `report` (table,
JSON, JUnit, plot), `distributed` (Ray sharding), `check` (`run_step1_check`, end to end).

Importing this package imports neither torch nor diffusers; the backends import them when they run.
"""

from __future__ import annotations

from .check import USAGE_ERRORS, injection_settings, run_step1_check
from .config import CheckConfig, ConfigError, load_config
from .metrics import METRIC_NAMES, ConsistencyMetrics, MetricValues, compute_metrics
from .report import Report, SampleInfo
from .tolerances import PROFILES, Tolerance, resolve_tolerance
from .verdict import CheckResult, Problem, Verdict, decide

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
]
