# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Judging: from two log-prob tables to PASS or FAIL, and the report that says why. Nothing here runs a side or
reads the check's `CheckConfig` (tests/test_layout.py keeps it so): what it knows of a check's settings comes as
one `JudgingSettings`, built from the config at the check's top; numpy only.

    views            the float64 working table and its views (cells, positions, timesteps, samples), vectorised
                     and the one reading of a user's tables (`host_array`, `float_table`, `flag_table`)
    metrics          the figures GRPO trainers log (`METRICS`: ratio mean/std, ppo_kl, clip fractions, approx_kl,
                     |Δlogp|): one `Metric` entry each
    mismatch         the mismatch statistics LLM trainers log (`STATISTICS`, reported, never gated)
    tolerances       the profiles (`PROFILES`: exact, implementation, kernel, calibrated) and their limits
    settings         `JudgingSettings`: how the two sides differ, how the figures are gated
    tolerance_model  which differences a configuration legitimately has, and how the calibrated floor combines
    verdict          the checks: the gated metrics and the guards on the comparison itself (windows included)
    causes           a likely cause as a report carries it (`Diagnosis`; the doctor finds them)
    report           the `Report`: terminal table, JSON, JUnit XML, plot
    loggers          the report in TensorBoard, wandb or MLflow (`Report.log_to`; each package an optional extra)
"""

from __future__ import annotations

from rollout_consistency.base.registry import Registry

from .causes import Diagnosis
from .loggers import LOGGED_NAMES, LoggerError, tracker_rows, tracker_scalars
from .metrics import (
    METRIC_NAMES,
    METRICS,
    ConsistencyMetrics,
    Metric,
    MetricsInputError,
    MetricValues,
    compute_metrics,
    get_metric,
)
from .mismatch import STATISTICS, MismatchStats, Statistic, compute_mismatch
from .report import Report, SampleInfo
from .settings import JudgingSettings
from .tolerance_model import difference_sources
from .tolerances import PROFILES, LimitContext, Profile, Tolerance, ToleranceError, get_profile, resolve_tolerance
from .verdict import CheckResult, Problem, Verdict, decide

__all__ = [
    "LOGGED_NAMES",
    "METRICS",
    "METRIC_NAMES",
    "PROFILES",
    "STATISTICS",
    "CheckResult",
    "ConsistencyMetrics",
    "Diagnosis",
    "JudgingSettings",
    "LimitContext",
    "LoggerError",
    "Metric",
    "MetricValues",
    "MetricsInputError",
    "MismatchStats",
    "Problem",
    "Profile",
    "Registry",
    "Report",
    "SampleInfo",
    "Statistic",
    "Tolerance",
    "ToleranceError",
    "Verdict",
    "compute_metrics",
    "compute_mismatch",
    "decide",
    "difference_sources",
    "get_metric",
    "get_profile",
    "resolve_tolerance",
    "tracker_rows",
    "tracker_scalars",
]
