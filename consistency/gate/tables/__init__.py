# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Your own tables: gate the log-prob tables your rollout and your trainer computed, with the check's metrics,
verdict and doctor (docs/ci.md).

    api              `gate(rollout_log_probs, trainer_log_probs, settings)` -> `GateReport`
    settings         `TableSettings`: how `gate()` judges the tables (profile, clip ranges, limits, ...)
    dump             `write_dump` / `read_dump`: the tables as one safetensors file (`rollout-consistency gate DUMP`)
    recorder         `Step1Recorder`: collects the tables inside a training loop, gates them at the first update;
                     `digest_ids`: sample ids for a loop that keeps none
    coverage         what the recorder recorded against what the rollout produced (in its report and its dump)
    pytest_fixtures  the ``step1_gate`` fixture and marker (loaded by the pytest plugin; it imports pytest, so
                     this package does not import it)
"""

from __future__ import annotations

from .api import GateInputError, GateReport, gate
from .dump import DumpFormatError, LogProbDump, read_dump, write_dump
from .recorder import RecorderError, Step1GateFailed, Step1Recorder, digest_ids
from .settings import GateSettings, TableSettings

__all__ = [
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
]
