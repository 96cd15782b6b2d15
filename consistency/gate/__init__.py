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
    check       `run_step1_check`, end to end; `weight_sync_check`, step 2; `batch_judging`, what both judge the
                batches by

Every name below is importable from here; the subpackages' own faces hold the rest. Importing this package
imports nothing else (no module of ours, no numpy): each name is loaded on first use, so a module deep in the gate
(the pytest plugin's fixtures, the run monitor's log reader) pays only for what it imports. Torch and diffusers
wait until a side runs.
"""

from __future__ import annotations

from rollout_consistency.base.lazy_face import lazy_face

# The module (under this package) that serves each name, imported on first use.
_SERVED_BY: dict[str, tuple[str, ...]] = {
    "backend_registry": ("BackendEntry", "backend_names", "register_backend"),
    "check": ("USAGE_ERRORS", "injection_settings", "run_step1_check"),
    "config": ("CheckConfig", "ConfigError", "load_config"),
    "diagnosis": ("Localisation", "SideSpec", "diagnose"),
    "diagnosis.localise": ("localise",),
    "judging": (
        "LOGGED_NAMES",
        "METRIC_NAMES",
        "PROFILES",
        "CheckResult",
        "ConsistencyMetrics",
        "Diagnosis",
        "LoggerError",
        "MetricValues",
        "MismatchStats",
        "Problem",
        "Report",
        "SampleInfo",
        "Tolerance",
        "Verdict",
        "compute_metrics",
        "compute_mismatch",
        "decide",
        "resolve_tolerance",
        "tracker_rows",
        "tracker_scalars",
    ),
    "monitor": ("MonitorSettings", "RunMonitor", "StepJudge", "StepStats"),
    "sides": ("PluginError", "PluginRollout", "RolloutPlugin", "RolloutRequest", "SideHandle", "TrainerPlugin"),
    "tables": (
        "DumpFormatError",
        "GateInputError",
        "GateReport",
        "GateSettings",
        "LogProbDump",
        "RecorderError",
        "Step1GateFailed",
        "Step1Recorder",
        "TableSettings",
        "digest_ids",
        "gate",
        "read_dump",
        "write_dump",
    ),
}
__all__ = sorted(name for names in _SERVED_BY.values() for name in names)
__getattr__, __dir__ = lazy_face(__name__, _SERVED_BY)
