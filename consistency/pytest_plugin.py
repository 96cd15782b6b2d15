# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""pytest plugin: enforce the step-1 consistency check in a GRPO repository's CI.

Installed with the package (entry point ``pytest11: rollout_consistency``), so any test session in an
environment with ``rollout-consistency`` installed can use, with no import:

* the ``step1_check`` fixture — a function ``step1_check(config=None, **settings) -> Report`` that runs
  `rollout_consistency.run_step1_check` and **fails the test** (with the table and every reason) unless it passes::

      def test_rollout_matches_trainer(step1_check):
          step1_check(model_path="checkpoints/step0", rollout_backend="vllm-omni", device="cuda")

* the ``step1_check`` marker with the settings as keywords, for a test that only needs the report
  (it receives it through the ``step1_report`` fixture, already checked)::

      @pytest.mark.step1_check(trajectory="dumps/step1.safetensors", profile="kernel")
      def test_dumped_rollout(step1_report):
          assert step1_report.metrics.overall.pg_clipfrac == 0

Options: ``--step1-config FILE`` (or ini ``step1_config``) gives base settings from a YAML/TOML file; keyword
settings override it. ``--step1-report-dir DIR`` (or ini ``step1_report_dir``) writes each check's JSON
report and JUnit XML there, named after the test, for CI artifacts.

The plugin costs nothing when unused: importing it imports only pytest; torch, diffusers and the checker
are imported on the first check.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

# Smoking K steps of the user's own loop under the run monitor: the run_monitor fixture, marker and summary fixture.
from rollout_consistency.gate.monitor.pytest_fixtures import (  # noqa: F401
    MONITOR_MARKER,
    run_monitor,
    run_monitor_summary,
)

# Gating the user's own tables or dump: the step1_gate fixture, marker and step1_gate_report fixture.
from rollout_consistency.gate.tables.pytest_fixtures import GATE_MARKER, step1_gate, step1_gate_report  # noqa: F401

MARKER = "step1_check"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rollout-consistency", "rollout-consistency step-1 check")
    group.addoption(
        "--step1-config", metavar="FILE", default=None, help="YAML/TOML settings for the step1_check fixture"
    )
    group.addoption(
        "--step1-report-dir", metavar="DIR", default=None, help="write each step-1 report (JSON, JUnit) here"
    )
    parser.addini("step1_config", "YAML/TOML settings for the step1_check fixture", default="")
    parser.addini("step1_report_dir", "directory for step-1 reports (JSON, JUnit)", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(**settings): run the rollout-consistency step-1 check with these settings (CheckConfig field "
        f"names); the test fails unless it passes. Use with the step1_report fixture.",
    )
    config.addinivalue_line(
        "markers",
        f"{GATE_MARKER}(dump, **settings): gate this log-prob dump (rollout_consistency.gate.gate keywords); the test "
        f"fails unless it passes. Use with the step1_gate_report fixture.",
    )
    config.addinivalue_line(
        "markers",
        f"{MONITOR_MARKER}(loop, steps=K, **settings): run K steps of loop(make_monitor, K) under the run monitor; "
        f"the test fails on any alarm. Use with the run_monitor_summary fixture.",
    )


def _option(config: pytest.Config, name: str) -> str | None:
    value = config.getoption(f"--{name.replace('_', '-')}", default=None) or config.getini(name)
    return str(value) if value else None


@pytest.fixture
def step1_check(request: pytest.FixtureRequest):
    """Run the step-1 check; fail the test unless it passes. Returns the `Report` on PASS.

    Call as ``step1_check(config=None, **settings)``: `config` is a `CheckConfig` (default: the
    ``--step1-config`` file, else the built-in defaults), `settings` override single fields.
    """
    from rollout_consistency.gate.config import load_config

    base_file = _option(request.config, "step1_config")
    report_dir = _option(request.config, "step1_report_dir")
    calls = []

    def run(config: Any = None, **settings: Any):
        from rollout_consistency.gate.check import run_step1_check

        settings.setdefault("progress", False)
        if config is None:
            config = load_config(base_file, **settings)
        elif settings:
            config = config.replace(**settings)
        report = run_step1_check(config)
        calls.append(report)
        if report_dir:
            stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid) + (f"-{len(calls)}" if len(calls) > 1 else "")
            report.write_json(Path(report_dir) / f"{stem}.json")
            report.write_junit(Path(report_dir) / f"{stem}.xml")
        if not report.passed:
            pytest.fail(
                "rollout-consistency step-1 check FAILED\n" + report.format_table(per_sample=True), pytrace=False
            )
        return report

    return run


@pytest.fixture
def step1_report(request: pytest.FixtureRequest, step1_check):
    """The `Report` of the check configured by the test's ``@pytest.mark.step1_check(**settings)`` marker."""
    marker = request.node.get_closest_marker(MARKER)
    if marker is None:
        raise pytest.UsageError(
            f"{request.node.nodeid}: the step1_report fixture needs @pytest.mark.{MARKER}(**settings) on the test"
        )
    if marker.args:
        raise pytest.UsageError(f"@pytest.mark.{MARKER} takes keyword settings only (CheckConfig field names)")
    return step1_check(**marker.kwargs)
