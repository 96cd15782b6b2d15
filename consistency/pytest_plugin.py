# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""pytest plugin: enforce the step-1 consistency check in a GRPO repository's CI.

Installed with the package (entry point ``pytest11: rollout_consistency``), so any test session in an
environment with ``rollout-consistency`` installed can use, with no import:

* the ``step1_check`` fixture — a function ``step1_check(config=None, **settings) -> Report`` that runs
  `rollout_consistency.run_step1_check` and **fails the test** (with the table and every reason) unless it passes::

      def test_rollout_matches_trainer(step1_check):
          step1_check(model_path="checkpoints/step0", rollout_backend="vllm-omni", device="cuda")

* the ``step1_check`` marker with the settings as keywords, for a test that only needs the report
  (it receives it through the ``step1_report`` fixture, already checked; a marked test that does not ask for
  it is checked all the same, as is one marked ``step1_gate``)::

      @pytest.mark.step1_check(trajectory="dumps/step1.safetensors", profile="kernel")
      def test_dumped_rollout(step1_report):
          assert step1_report.metrics.overall.pg_clipfrac == 0

Options: ``--step1-config FILE`` (or ini ``step1_config``) gives base settings from a YAML/TOML file; keyword
settings override it. ``--step1-report-dir DIR`` (or ini ``step1_report_dir``) writes each check's JSON
report and JUnit XML there, named after the test, for CI artifacts.

A check whose settings name user code (a plug-in, a backend registered by user code, a weight-sync spec) runs
supervised in a fresh interpreter (`rollout_consistency.safeguards.supervised_call`): its ``os._exit(0)`` or hang fails the
test instead of ending or hanging the session.

The plugin costs nothing when unused: importing it imports pytest and the two fixtures modules (the gate's
package faces are lazy: no numpy, none of the checker); numpy, torch, diffusers and the checker are imported on
the first check.
"""

from __future__ import annotations

from typing import Any

import pytest

# Smoking K steps of the user's own loop under the run monitor: the run_monitor fixture, marker and summary fixture.
from rollout_consistency.gate.monitor.pytest_fixtures import (  # noqa: F401
    MONITOR_MARKER,
    run_monitor,
    run_monitor_summary,
)

# Gating the user's own tables or dump: the step1_gate fixture, marker and step1_gate_report fixture.
from rollout_consistency.gate.tables.pytest_fixtures import (  # noqa: F401
    GATE_MARKER,
    report_writer,
    step1_gate,
    step1_gate_report,
)

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
    write_reports = report_writer(request)

    def run(config: Any = None, **settings: Any):
        settings.setdefault("progress", False)
        if config is None:
            config = load_config(base_file, **settings)
        elif settings:
            config = config.replace(**settings)
        report = _run_check(config)
        write_reports(report)
        if not report.passed:
            pytest.fail(
                "rollout-consistency step-1 check FAILED\n" + report.format_table(per_sample=True), pytrace=False
            )
        return report

    return run


def _run_check(config: Any) -> Any:
    """The check's `Report`: in this process when both sides are built-in backends; supervised in a fresh
    interpreter when the settings name user code (a plug-in, a backend your code registered, a weight-sync spec),
    whose ``os._exit(0)`` would otherwise end the pytest session with exit 0, and whose hang would hang it."""
    from rollout_consistency.gate.check import run_step1_check
    from rollout_consistency.safeguards.supervised_call import SupervisedCallError, call_supervised

    entries = _user_backends(config)
    if entries is None:
        return run_step1_check(config)
    try:
        return call_supervised(_check_in_child, config, entries, prog="rollout-consistency step1_check")
    except SupervisedCallError as error:
        pytest.fail(f"rollout-consistency step-1 check could not run: {error}", pytrace=False)


def _user_backends(config: Any) -> tuple[Any, ...] | None:
    """None when `config` runs only our code; else the backends registered in this process that it names (a fresh
    interpreter knows only the built-in ones)."""
    from rollout_consistency.gate.backend_registry import get_backend, is_plugin_spec

    entries, user_code = [], is_plugin_spec(config.weight_sync)
    for side in ("rollout", "trainer"):
        name = getattr(config, f"{side}_backend")
        if is_plugin_spec(name):
            user_code = True
            continue
        entry = get_backend(side, name)
        if not entry.factory.startswith("rollout_consistency."):
            user_code = True
            entries.append(entry)
    return tuple(entries) if user_code else None


def _check_in_child(config: Any, entries: tuple[Any, ...]) -> Any:
    from rollout_consistency.gate.backend_registry import register_backend
    from rollout_consistency.gate.check import run_step1_check

    for entry in entries:
        register_backend(entry)
    return run_step1_check(config)


@pytest.fixture(autouse=True)
def _rollout_consistency_markers(request: pytest.FixtureRequest) -> None:
    """A test marked ``step1_check`` / ``step1_gate`` is gated whether or not it asks for the report: the check
    runs (and fails the test) before its body."""
    if request.node.get_closest_marker(MARKER) is not None:
        request.getfixturevalue("step1_report")
    if request.node.get_closest_marker(GATE_MARKER) is not None:
        request.getfixturevalue("step1_gate_report")


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
