"""rollout_consistency.gate.judging.report: stable JSON schema, strict JSON, JUnit XML that parses, the plot, the table."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from rollout_consistency.gate.config import CheckConfig
from rollout_consistency.gate.judging.metrics import compute_metrics
from rollout_consistency.gate.judging.report import SCHEMA_NAME, SCHEMA_VERSION, Report, SampleInfo
from rollout_consistency.gate.judging.tolerances import exact_tolerance, kernel_tolerance
from rollout_consistency.gate.judging.verdict import Problem, decide

STEPS = np.tile(np.float32([900, 750]), (4, 1))

# The schema promise: these keys, in this order. Renaming or removing one must bump SCHEMA_VERSION.
TOP_KEYS = [
    "schema",
    "schema_version",
    "status",
    "passed",
    "reasons",
    "verdict",
    "tolerance",
    "metrics",
    "samples",
    "config",
    "precision",
    "notes",
    "run",
    "diagnosis",
    "mismatch",
]
METRICS_KEYS = [
    "overall",
    "by_position",
    "by_timestep",
    "by_sample",
    "nonfinite",
    "missing",
    "empty_samples",
    "num_samples",
    "num_positions",
    "micro_batch_size",
    "clip_ratio_low",
    "clip_ratio_high",
]
VALUE_KEYS = [
    "ratio_mean",
    "ratio_std",
    "ppo_kl",
    "pg_clipfrac",
    "pg_clipfrac_higher",
    "pg_clipfrac_lower",
    "approx_kl",
    "mean_abs_dlogp",
    "max_abs_dlogp",
    "count",
]
CHECK_KEYS = ["name", "kind", "passed", "message", "value", "limit", "excess", "steps", "timesteps"]


def make_report(trainer_delta=0.0, nan=False, tolerance=None, metrics=True) -> Report:
    rollout = np.zeros((4, 2), np.float32)
    trainer = np.full((4, 2), trainer_delta, np.float32)
    if nan:
        trainer[1, 1] = np.nan
    m = compute_metrics(rollout, trainer, timesteps=STEPS, micro_batch_size=2) if metrics else None
    tol = tolerance or exact_tolerance()
    problems = [] if metrics else [Problem("shapes", "rollout (4, 2) vs trainer (4, 3)")]
    return Report(
        verdict=decide(m, tol, problems),
        tolerance=tol,
        metrics=m,
        samples=tuple(SampleInfo(i, i // 2, i // 2, 100 + i, 1, 2) for i in range(4)),
        config=CheckConfig().to_dict(),
        notes=("a note",),
        run={"mode": "in-process", "timings_s": {"total": 1.5}},
    )


def test_json_schema_keys_are_stable():
    data = json.loads(make_report(1e-4).to_json())
    assert list(data) == TOP_KEYS
    assert data["schema"] == SCHEMA_NAME and data["schema_version"] == SCHEMA_VERSION == 1
    assert list(data["metrics"]) == METRICS_KEYS
    assert list(data["metrics"]["overall"]) == VALUE_KEYS
    assert list(data["verdict"]["checks"][0]) == CHECK_KEYS
    assert list(data["tolerance"]) == ["profile", "limits", "floor", "multiple", "overridden", "basis", "pooled"]
    assert list(data["samples"][0]) == ["index", "prompt_index", "prompt_group", "seed", "window_start", "window_size"]
    assert data["status"] == "FAIL" and data["passed"] is False and data["reasons"]


def test_json_is_strict_and_round_trips_non_finite_values():
    report = make_report(nan=True)
    text = report.to_json()
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    again = Report.from_json(text)
    assert again.to_json() == text
    assert math.isnan(again.metrics.overall.ppo_kl) and again.results_dict() == report.results_dict()


def test_results_dict_leaves_out_run_metadata():
    a, b = make_report(1e-4), make_report(1e-4)
    b = Report(b.verdict, b.tolerance, b.metrics, b.samples, config={"workers": 2}, run={"mode": "ray"})
    assert a.results_dict() == b.results_dict() and a.to_dict() != b.to_dict()


def test_from_dict_refuses_other_schemas():
    data = make_report().to_dict()
    with pytest.raises(ValueError, match="schema_version"):
        Report.from_dict({**data, "schema_version": 99})
    with pytest.raises(ValueError, match="not a step-1 report"):
        Report.from_dict({**data, "schema": "something-else"})


@pytest.mark.parametrize("delta, metrics", [(0.0, True), (3e-4, True), (0.0, False)])
def test_junit_parses_with_one_testcase_per_check(tmp_path, delta, metrics):
    report = make_report(delta, metrics=metrics)
    path = tmp_path / "junit.xml"
    report.write_junit(path)
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    suite = root.find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == len(report.verdict.checks) == int(suite.get("tests"))
    failures = [c for c in cases if c.find("failure") is not None]
    assert len(failures) == int(suite.get("failures")) == sum(not c.passed for c in report.verdict.checks)
    assert bool(failures) == (not report.passed)
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props["status"] == report.status and props["profile"] == "exact"
    if delta:
        ppo = next(c for c in cases if c.get("name") == "ppo_kl")
        assert "exact limit 0" in ppo.find("failure").get("message")
        assert ppo.get("classname") == "rollout_consistency.step1.exact.metric"


@pytest.mark.parametrize(
    "delta, nan, metrics", [(0.0, False, True), (2e-4, False, True), (0.0, True, True), (0.0, False, False)]
)
def test_plot_is_a_png(tmp_path, delta, nan, metrics):
    path = tmp_path / "sub" / "plot.png"
    make_report(delta, nan=nan, tolerance=kernel_tolerance(), metrics=metrics).write_plot(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000


def test_table_shows_status_figures_steps_and_reasons():
    table = make_report(2e-4, tolerance=kernel_tolerance()).format_table(per_sample=True)
    assert table.splitlines()[0] == "rollout-consistency step-1 check: FAIL"
    assert "ppo_kl" in table and "|x| <= 0.0001" in table and "(not gated)" in table
    assert "per timestep" in table and "per sample" in table and "FAIL because:" in table
    assert "note: a note" in table
    ok = make_report().format_table()
    assert ok.startswith("rollout-consistency step-1 check: PASS") and "FAIL because" not in ok


def test_table_header_says_what_the_cells_are_and_the_position_column_is_named_for_what_it_holds():
    """The per-timestep column holds the table column (the step's place in the SDE window), not a denoising step;
    without a micro-batch size the header does not call the sample count a micro-batch (the recorder's case)."""
    from rollout_consistency.gate import gate

    rollout = np.random.default_rng(0).normal(-1.0, 0.1, (4, 2)).astype(np.float32)
    window_starts = np.array([0, 0, 3, 3])  # two prompt groups, windows at steps 0-1 and 3-4
    timesteps = np.array([[1000.0, 900.0], [1000.0, 900.0], [700.0, 600.0], [700.0, 600.0]], np.float32)
    settings = dict(timesteps=timesteps, window_starts=window_starts, prompt_groups=[0, 0, 1, 1])
    lines = gate(rollout, rollout.copy(), **settings).format_table().splitlines()
    assert lines[1].endswith("| micro-batch not given: one cell of 4 samples per step")
    title = lines.index(next(line for line in lines if line.startswith("  per timestep")))
    assert "pos: its column of the log-prob table" in lines[title]
    assert lines[title + 1].split()[:3] == ["pos", "t", "n"]
    rows = [line.split()[:2] for line in lines[title + 2 : title + 6]]
    assert rows == [["0", "1000"], ["1", "900"], ["0", "700"], ["1", "600"]]  # window places, not steps 0..4
    micro = gate(rollout, rollout.copy(), micro_batch_size=2).format_table().splitlines()[1]
    assert micro.endswith("| micro-batch 2")
