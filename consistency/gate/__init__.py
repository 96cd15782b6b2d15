# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The step-1 gate: do the rollout and the trainer compute the same log-probabilities before the first update?

Data flows one way, each arrow a plain function call (or a Ray call over the same function)::

    CheckConfig ─ make_plan ─▶ rollout backend ─▶ float32 Trajectory ─▶ trainer backend ─▶ log-probs
                                                        compute_metrics ─▶ decide ─▶ Report

Modules: `config` (settings, files, aliases), `plan` (prompts, seeds, SDE windows, batches), `backends`
(the built-in rollout and trainer backends), `metrics`, `mismatch` (mismatch statistics), `tolerances`
(profiles), `verdict`, `report` (table, JSON, JUnit, plot), `distributed` (Ray sharding), `check`
(`run_step1_check`, end to end).

Gating your own rollout and trainer (docs/ci.md): `gate(rollout_log_probs, trainer_log_probs, ...)` (`api`)
compares two log-prob tables you computed; `Step1Recorder` (`recorder`) collects them inside a training loop;
`write_dump` / `read_dump` (`dump`) store them; `cli` and `pytest_fixtures` are the `rollout-consistency gate`
command and the `step1_gate` pytest fixture.

Importing this package imports neither torch nor diffusers; the backends import them when they run.
"""

from __future__ import annotations

from .check import USAGE_ERRORS, injection_settings, run_step1_check
from .config import CheckConfig, ConfigError, load_config
from .judging.metrics import METRIC_NAMES, ConsistencyMetrics, MetricValues, compute_metrics
from .judging.mismatch import MismatchStats, compute_mismatch
from .judging.report import Report, SampleInfo
from .judging.tolerances import PROFILES, Tolerance, resolve_tolerance
from .judging.verdict import CheckResult, Problem, Verdict, decide
from .tables.api import GateInputError, GateReport, gate
from .tables.dump import DumpFormatError, LogProbDump, read_dump, write_dump
from .tables.recorder import RecorderError, Step1GateFailed, Step1Recorder

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
    "MetricValues",
    "MismatchStats",
    "Problem",
    "RecorderError",
    "Report",
    "SampleInfo",
    "Step1GateFailed",
    "Step1Recorder",
    "Tolerance",
    "Verdict",
    "compute_metrics",
    "compute_mismatch",
    "decide",
    "gate",
    "injection_settings",
    "load_config",
    "read_dump",
    "resolve_tolerance",
    "run_step1_check",
    "write_dump",
]
