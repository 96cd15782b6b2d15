# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""pytest fixtures that gate the user's own log-prob tables or dump (part of the ``rollout_consistency`` plugin).

* ``step1_gate`` fixture — ``step1_gate(dump)`` or ``step1_gate(rollout_log_probs, trainer_log_probs,
  **settings)`` runs `rollout_consistency.gate.gate` (settings: its keywords — ``profile``, ``clip_ratio``,
  ``timesteps``, ...) and **fails the test** with the table and every reason unless it passes; returns the
  `GateReport`;
* ``step1_gate`` marker — ``@pytest.mark.step1_gate("dump.safetensors", profile="kernel")``; the test
  receives the passed report through the ``step1_gate_report`` fixture.

``--step1-report-dir DIR`` (ini ``step1_report_dir``) also writes each gate's JSON report and JUnit XML there,
named after the test ([`report_writer`], which the ``step1_check`` fixture uses too). Importing this module imports
only pytest.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

GATE_MARKER = "step1_gate"


def report_writer(request: pytest.FixtureRequest) -> Callable[[Any], None]:
    """What a fixture calls with each report it makes (a `Report` or a `GateReport`): under ``--step1-report-dir
    DIR`` (ini ``step1_report_dir``) it writes the report's JSON and JUnit XML there, named after the test
    (``-2``, ``-3``, ... for the test's later reports); without it, nothing."""
    config = request.config
    report_dir = config.getoption("--step1-report-dir", default=None) or config.getini("step1_report_dir")
    written = 0

    def write(report: Any) -> None:
        nonlocal written
        written += 1
        if report_dir:
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid) + (f"-{written}" if written > 1 else "")
            report.write_json(Path(report_dir) / f"{stem}.json")
            report.write_junit(Path(report_dir) / f"{stem}.xml")

    return write


@pytest.fixture
def step1_gate(request: pytest.FixtureRequest):
    """Gate a dump or two tables; fail the test unless it passes. Returns the `GateReport` on PASS.

    Call as ``step1_gate(dump_path)`` or ``step1_gate(rollout_log_probs, trainer_log_probs, **settings)``.
    """
    write_reports = report_writer(request)

    def run(*tables: Any, **settings: Any):
        from rollout_consistency.gate.tables.api import gate
        from rollout_consistency.gate.tables.dump import read_dump

        if len(tables) == 1 and isinstance(tables[0], (str, os.PathLike)):
            report = read_dump(tables[0]).gate(source=str(tables[0]), **settings)
        elif len(tables) == 2:
            report = gate(*tables, **settings)
        else:
            raise pytest.UsageError(
                "step1_gate takes a dump path, or the rollout and trainer log-prob tables (then keyword settings)"
            )
        write_reports(report)
        if not report.passed:
            pytest.fail("rollout-consistency step-1 gate FAILED\n" + report.format_table(), pytrace=False)
        return report

    return run


@pytest.fixture
def step1_gate_report(request: pytest.FixtureRequest, step1_gate):
    """The `GateReport` of the dump named by the test's ``@pytest.mark.step1_gate(dump, **settings)`` marker."""
    marker = request.node.get_closest_marker(GATE_MARKER)
    if marker is None or len(marker.args) != 1:
        raise pytest.UsageError(
            f"{request.node.nodeid}: the step1_gate_report fixture needs @pytest.mark.{GATE_MARKER}(DUMP, **settings)"
        )
    return step1_gate(marker.args[0], **marker.kwargs)
