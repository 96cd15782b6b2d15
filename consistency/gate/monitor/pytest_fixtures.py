# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""pytest: smoke K steps of your own tiny training loop under the run monitor, and fail on any alarm (part of the
``rollout_consistency`` plugin; docs/monitor.md, "Smoke K steps in CI").

* ``run_monitor`` fixture — ``run_monitor(loop, steps=K, **settings)`` calls ``loop(make_monitor, K)``: your loop
  builds its model and optimizer, then ``monitor = make_monitor(optimizer=optimizer)`` (a `RunMonitor` with the
  fixture's settings: `MonitorSettings` / `TableSettings` fields as keywords), and trains K steps with the monitor's
  hooks. The test **fails** with the monitor's summary unless every monitor made judged at least K steps with no
  alarm (a monitor that judged fewer — or none — fails: a smoke that watched nothing proves nothing). Returns the
  summaries.
* ``run_monitor`` marker — ``@pytest.mark.run_monitor(loop, steps=K, **settings)``; the test receives the summaries
  through the ``run_monitor_summary`` fixture.

Importing this module imports only pytest.
"""

from __future__ import annotations

from typing import Any

import pytest

MONITOR_MARKER = "run_monitor"


@pytest.fixture
def run_monitor(request: pytest.FixtureRequest):
    """Run ``loop(make_monitor, steps)`` and fail the test on any alarm or on fewer than `steps` judged steps."""

    def run(loop: Any, *, steps: int, **settings: Any) -> list[Any]:
        from rollout_consistency.gate.monitor import RunMonitor

        if not callable(loop) or not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise pytest.UsageError("run_monitor(loop, steps=K, **settings): loop is callable, K a positive int")
        made: list[Any] = []

        def make_monitor(**options: Any) -> Any:
            monitor = RunMonitor(**{"on_alarm": "log", **settings, **options})
            made.append(monitor)
            return monitor

        loop(make_monitor, steps)
        if not made:
            pytest.fail(f"run_monitor: the loop never called make_monitor(...): no step of {steps} was judged")
        summaries = [monitor.close() for monitor in made]
        problems = []
        for monitor, summary in zip(made, summaries, strict=True):
            text = summary.format()
            records = "\n".join(r.format() for r in monitor.alarm_records[:5])
            if summary.steps_judged < steps:
                problems.append(f"judged {summary.steps_judged} of the {steps} steps asked for\n{text}")
            elif not summary.passed:
                problems.append(text + ("\n" + records if records else ""))
        if problems:
            pytest.fail("rollout-consistency run monitor FAILED\n" + "\n".join(problems), pytrace=False)
        return summaries

    return run


@pytest.fixture
def run_monitor_summary(request: pytest.FixtureRequest, run_monitor):
    """The summaries of the loop named by the test's ``@pytest.mark.run_monitor(loop, steps=K, **settings)``."""
    marker = request.node.get_closest_marker(MONITOR_MARKER)
    if marker is None or len(marker.args) != 1 or "steps" not in marker.kwargs:
        raise pytest.UsageError(
            f"{request.node.nodeid}: the run_monitor_summary fixture needs "
            f"@pytest.mark.{MONITOR_MARKER}(loop, steps=K, **settings)"
        )
    return run_monitor(marker.args[0], **marker.kwargs)
