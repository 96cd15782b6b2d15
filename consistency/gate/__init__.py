# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The step-1 gate: do the rollout and the trainer compute the same log-probabilities before the first update?

Data flows one way, each arrow a plain function call (or a Ray call over the same function)::

    CheckConfig ─ make_plan ─▶ rollout backend ─▶ float32 Trajectory ─▶ trainer backend ─▶ log-probs
                                                        compute_metrics ─▶ decide ─▶ Report

The package, in layers (each imports only from those above it; tests/test_layout.py):

    judging     metrics, mismatch statistics, tolerance profiles, verdict, report (table, JSON, JUnit, plot, trackers)
    config      `CheckConfig`: every setting, files, aliases (with `bounds` and `safe_yaml`), and the
                backends by name (`backend_registry`: `BackendEntry`, `register_backend`)
    sides       the plan, the built-in backends and plug-in sides, the trainer's recompute, Ray, weight sync
    diagnosis   the doctor's ranked likely causes and the localising replay
    tables      your own tables: `gate()`, log-prob dumps, `Step1Recorder`, the `step1_gate` fixture
    monitor     the run monitor: every training step's figures, verdict and alarms (`RunMonitor`, `StepStats`,
                `StepJudge`), the `run_monitor` fixture
    check       `run_step1_check`, end to end

Every name below is importable from here; the subpackages' own faces hold the rest. Importing this package
imports neither torch nor diffusers; the sides import them when they run.
"""

from __future__ import annotations

from .backend_registry import BackendEntry, backend_names, register_backend
from .check import USAGE_ERRORS, injection_settings, run_step1_check
from .config import CheckConfig, ConfigError, load_config
from .diagnosis import Localisation, SideSpec, diagnose
from .diagnosis.localise import localise
from .judging import (
    LOGGED_NAMES,
    METRIC_NAMES,
    PROFILES,
    CheckResult,
    ConsistencyMetrics,
    Diagnosis,
    LoggerError,
    MetricValues,
    MismatchStats,
    Problem,
    Report,
    SampleInfo,
    Tolerance,
    Verdict,
    compute_metrics,
    compute_mismatch,
    decide,
    resolve_tolerance,
    tracker_rows,
    tracker_scalars,
)
from .monitor import MonitorSettings, RunMonitor, StepJudge, StepStats
from .sides import PluginError, PluginRollout, RolloutPlugin, RolloutRequest, SideHandle, TrainerPlugin
from .tables import (
    DumpFormatError,
    GateInputError,
    GateReport,
    GateSettings,
    LogProbDump,
    RecorderError,
    Step1GateFailed,
    Step1Recorder,
    TableSettings,
    digest_ids,
    gate,
    read_dump,
    write_dump,
)

__all__ = [
    "LOGGED_NAMES",
    "METRIC_NAMES",
    "PROFILES",
    "USAGE_ERRORS",
    "BackendEntry",
    "CheckConfig",
    "CheckResult",
    "ConfigError",
    "ConsistencyMetrics",
    "Diagnosis",
    "DumpFormatError",
    "GateInputError",
    "GateReport",
    "GateSettings",
    "Localisation",
    "LogProbDump",
    "LoggerError",
    "MetricValues",
    "MismatchStats",
    "MonitorSettings",
    "PluginError",
    "PluginRollout",
    "Problem",
    "RecorderError",
    "Report",
    "RolloutPlugin",
    "RolloutRequest",
    "RunMonitor",
    "SampleInfo",
    "SideHandle",
    "SideSpec",
    "Step1GateFailed",
    "Step1Recorder",
    "StepJudge",
    "StepStats",
    "TableSettings",
    "Tolerance",
    "TrainerPlugin",
    "Verdict",
    "backend_names",
    "compute_metrics",
    "compute_mismatch",
    "decide",
    "diagnose",
    "digest_ids",
    "gate",
    "injection_settings",
    "load_config",
    "localise",
    "read_dump",
    "register_backend",
    "resolve_tolerance",
    "run_step1_check",
    "tracker_rows",
    "tracker_scalars",
    "write_dump",
]
