"""The judging registries: every built-in metric, statistic and profile pinned down, and a new entry of each kind
reaching every output through its one registration."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from rollout_consistency.gate import CheckConfig, gate
from rollout_consistency.gate.judging import (
    METRICS,
    PROFILES,
    STATISTICS,
    LimitContext,
    Metric,
    MetricValues,
    Profile,
    Registry,
    Statistic,
    compute_metrics,
    compute_mismatch,
    decide,
    resolve_tolerance,
)
from rollout_consistency.gate.judging.tolerances import limit_by_scale, table_profiles

A, B = 2.0**-8, -(2.0**-7)  # exact in float32, so Δlogp is exactly these
ROLLOUT = np.zeros((3, 2), np.float32)
TRAINER = np.array([[A, 0.0], [0.0, B], [A, B]], np.float32)


# -- metrics ------------------------------------------------------------------------------------------
def test_metric_entries_are_pinned():
    rows = [
        (m.name, m.pool, m.scale, m.agreement, m.column, m.table_format, m.message_format, m.aliases)
        for m in METRICS.values()
    ]
    assert rows == [
        ("ratio_mean", "mean", "bias", 1.0, "ratio_mean", ".9f", ".9f", ()),
        ("ratio_std", "std", "spread", None, "ratio_std", ".3e", ".3g", ()),
        ("ppo_kl", "mean", "bias", 0.0, "ppo_kl", ".3e", ".3g", ("kl",)),
        ("pg_clipfrac", "mean", "fraction", None, "clipfrac", ".4f", ".3g", ("clipfrac",)),
        (
            "pg_clipfrac_higher",
            "mean",
            "fraction",
            None,
            "clip_hi",
            ".4f",
            ".3g",
            ("clipfrac_gt_one", "clipfrac_higher"),
        ),
        ("pg_clipfrac_lower", "mean", "fraction", None, "clip_lo", ".4f", ".3g", ("clipfrac_lt_one", "clipfrac_lower")),
        ("approx_kl", "mean", "rms", None, "approx_kl", ".3e", ".3g", ()),
        ("mean_abs_dlogp", "mean", "spread", None, "mean|dlogp|", ".3e", ".3g", ()),
        ("max_abs_dlogp", "max", "max", None, "max|dlogp|", ".3e", ".3g", ()),
    ]


def test_every_metric_by_hand():
    """One micro-batch: the cells are the two window positions, [a, 0, a] and [0, b, b]."""
    o = compute_metrics(ROLLOUT, TRAINER, clip_ratio=1e-3).overall
    ea, eb = math.exp(A), math.exp(B)
    cells = [[ea, 1.0, ea], [1.0, eb, eb]]
    means = [sum(c) / 3 for c in cells]
    assert o.ratio_mean == pytest.approx(sum(means) / 2, rel=1e-15)
    stds = [math.sqrt(sum((r - m) ** 2 for r in c) / 3) for c, m in zip(cells, means, strict=True)]
    assert o.ratio_std == pytest.approx(sum(stds) / 2, rel=1e-12)
    assert o.ppo_kl == pytest.approx((-2 * A / 3 - 2 * B / 3) / 2, rel=1e-15)
    assert (o.pg_clipfrac, o.pg_clipfrac_higher, o.pg_clipfrac_lower) == pytest.approx((2 / 3, 1 / 3, 1 / 3))
    assert o.approx_kl == pytest.approx((A * A / 3 + B * B / 3) / 2, rel=1e-15)
    assert o.mean_abs_dlogp == pytest.approx((2 * A / 3 + 2 * -B / 3) / 2, rel=1e-15)
    assert o.max_abs_dlogp == -B and o.count == 6


def test_metric_deviation_and_texts():
    ratio, kl, top = METRICS["ratio_mean"], METRICS["ppo_kl"], METRICS["max_abs_dlogp"]
    assert (ratio.deviation(0.999), kl.deviation(-2e-5), top.deviation(3e-5)) == pytest.approx((1e-3, 2e-5, 3e-5))
    assert (ratio.limit_text(1e-4), kl.limit_text(1e-4), top.limit_text(1e-3)) == (
        "|x-1| <= 0.0001",
        "|x| <= 0.0001",
        "<= 0.001",
    )
    assert ratio.limit_text(None) == "(not gated)" and ratio.deviation_text(2.5e-5) == "|ratio_mean - 1| = 2.5e-05"
    assert (ratio.format(0.99996), METRICS["pg_clipfrac"].format(0.25), kl.format(0.0), kl.format(math.nan)) == (
        "0.999960000",
        "0.2500",
        "0",
        "nan",
    )


def test_metric_entries_refuse_what_the_engine_cannot_pool():
    with pytest.raises(ValueError, match="pool"):
        Metric("x", "d", lambda e: e.delta, pool="median")
    with pytest.raises(ValueError, match="scale"):
        Metric("x", "d", lambda e: e.delta, scale="huge")
    with pytest.raises(ValueError, match="identifier"):
        Metric("max |dlogp|", "d", lambda e: e.delta)


# -- profiles -----------------------------------------------------------------------------------------
def test_profile_entries_are_pinned():
    rows = [(p.name, p.pooled, p.needs_floor, p.bit_exact, p.unmeasured) for p in PROFILES.values()]
    assert rows == [
        ("exact", False, False, True, "exact"),
        ("implementation", True, False, False, "implementation"),
        ("kernel", True, False, False, "kernel"),
        ("calibrated", True, True, False, "kernel"),
    ]
    assert table_profiles() == ("exact", "implementation", "kernel")


FLOOR = MetricValues(
    ratio_mean=1 - 2e-6,
    ratio_std=1e-6,
    ppo_kl=-1e-7,
    pg_clipfrac=0.1,
    pg_clipfrac_higher=0.05,
    pg_clipfrac_lower=0.05,
    approx_kl=1e-12,
    mean_abs_dlogp=3e-6,
    max_abs_dlogp=2e-5,
    count=8,
)
RMS = 0.5 * (2 * 3e-4) ** 2


@pytest.mark.parametrize(
    "profile, context, limits",
    [
        ("exact", LimitContext(), dict.fromkeys(METRICS, 0.0)),
        (
            "implementation",
            LimitContext(),
            {
                "ratio_mean": 1e-6,
                "ratio_std": 1e-6,
                "ppo_kl": 1e-6,
                "approx_kl": 2e-12,
                "mean_abs_dlogp": 1e-6,
                "max_abs_dlogp": 1e-5,
            },
        ),
        (
            "kernel",
            LimitContext(compute_dtype="bfloat16"),
            {
                "ratio_mean": 1e-4,
                "ratio_std": 3e-4,
                "ppo_kl": 1e-4,
                "approx_kl": RMS,
                "mean_abs_dlogp": 3e-4,
                "max_abs_dlogp": 1e-3,
            },
        ),
        (
            "kernel",
            LimitContext(compute_dtype="float32"),
            {
                "ratio_mean": 1.25e-5,
                "ratio_std": 3.75e-5,
                "ppo_kl": 1.25e-5,
                "approx_kl": RMS / 64,
                "mean_abs_dlogp": 3.75e-5,
                "max_abs_dlogp": 1.25e-4,
            },
        ),
        (
            "calibrated",
            LimitContext(floor=FLOOR, multiple=4.0),
            {
                "ratio_mean": 1.2e-5,
                "ratio_std": 1.2e-5,
                "ppo_kl": 1.2e-5,
                "approx_kl": 16e-12,
                "mean_abs_dlogp": 1.2e-5,
                "max_abs_dlogp": 8e-5,
            },
        ),
    ],
)
def test_every_profile_limits_every_metric(profile, context, limits):
    tolerance = PROFILES[profile].tolerance(context)
    assert list(tolerance.limits) == list(limits)  # clip fractions: reported, not gated, unless exact
    assert tolerance.limits == pytest.approx(limits, rel=1e-12)
    assert tolerance.pooled == PROFILES[profile].pooled and tolerance.profile == profile


def test_calibrated_needs_a_finite_floor():
    with pytest.raises(ValueError, match="needs the measured floor"):
        PROFILES["calibrated"].tolerance(LimitContext())
    bad = MetricValues({**FLOOR.to_dict(), "count": 8, "max_abs_dlogp": math.nan}, count=8)
    with pytest.raises(ValueError, match="not finite"):
        PROFILES["calibrated"].tolerance(LimitContext(floor=bad))


# -- statistics ---------------------------------------------------------------------------------------
def test_statistic_entries_are_pinned():
    rows = [(s.name, s.column, s.needs_advantages) for s in STATISTICS.values()]
    assert rows == [
        ("k3_kl", "k3_kl", False),
        ("chi2", "chi2", False),
        ("ess", "ess", False),
        ("p99_abs_dlogp", "p99|dlogp|", False),
        ("max_abs_dlogp", "max|dlogp|", False),
        ("pearson_logp", "pearson", False),
        ("bias", "bias", False),
        ("bias_ci_low", None, False),
        ("bias_ci_high", None, False),
        ("kl", None, False),
        ("chi2_token", None, False),
        ("chi2_seq", None, False),
        ("ppl_ratio", None, False),
        ("log_ppl_diff", None, False),
        ("log_ppl_abs_diff", None, False),
        ("pg_clipfrac_adv", "clip_adv", True),
        ("pg_clipfrac_dual", "clip_dual", True),
    ]


def test_every_statistic_by_hand():
    rollout = np.array([[-1.0, -2.0], [-1.5, -0.5]], np.float32)
    d = np.array([[A, 0.0], [B, A]])  # per-sample means A/2 and (B + A)/2 = -A/2
    trainer = (rollout + d).astype(np.float32)
    advantages = np.array([1.0, -1.0])
    s = compute_mismatch(rollout, trainer, advantages=advantages, clip_ratio_low=1e-3, clip_ratio_high=1e-3).overall
    delta = (trainer.astype(np.float64) - rollout).ravel()
    w = np.exp(delta)
    means = [delta[:2].mean(), delta[2:].mean()]
    bias = sum(means) / 2
    half = 1.959963984540054 * abs(means[0] - means[1]) / math.sqrt(2) / math.sqrt(2)  # s with n - 1 = 1
    want = {
        "k3_kl": np.mean(w - 1 - delta),
        "chi2": np.mean((w - 1) ** 2),
        "ess": np.mean(w) ** 2 / np.mean(w**2),
        "p99_abs_dlogp": np.percentile(np.abs(delta), 99),
        "max_abs_dlogp": np.abs(delta).max(),
        "pearson_logp": np.corrcoef(rollout.ravel(), trainer.ravel())[0, 1],
        "bias": bias,
        "bias_ci_low": bias - half,
        "bias_ci_high": bias + half,
        "kl": -delta.mean(),
        "chi2_token": np.mean(w**2) - 1,
        "chi2_seq": np.mean(np.exp(2 * np.array([delta[:2].sum(), delta[2:].sum()]))) - 1,
        "ppl_ratio": np.mean(np.exp(-np.array(means))),
        "log_ppl_diff": -bias,
        "log_ppl_abs_diff": np.mean(np.abs(means)),
        # sample 0 (A > 0): w > 1 + 1e-3 where Δ = A; sample 1 (A < 0): w < 1 - 1e-3 where Δ = B
        "pg_clipfrac_adv": 2 / 4,
        "pg_clipfrac_dual": 0.0,
    }
    assert s.count == 4 and list(s.names()) == list(want)
    for name, value in want.items():
        assert s.get(name) == pytest.approx(float(value), rel=1e-9, abs=1e-15), name


# -- the registry mechanics -----------------------------------------------------------------------------
def test_registry_names_refuses_and_restores():
    registry: Registry[Metric] = Registry("metric")
    first = registry.register(Metric("first", "d", lambda e: e.delta))
    assert registry.register(first) is first and list(registry) == ["first"]  # the same object: a no-op
    with pytest.raises(ValueError, match="already registered"):
        registry.register(Metric("first", "other", lambda e: e.delta))
    other = registry.register(Metric("first", "other", lambda e: e.delta), replace=True)
    assert registry["first"] is other and len(registry) == 1
    with registry.scoped():
        registry.register(Metric("second", "d", lambda e: e.delta))
        assert "second" in registry
    assert registry.names() == ("first",)
    with pytest.raises(KeyError, match="Did you mean 'first'"):
        registry["frist"]
    assert registry.unregister("first") is other and not registry


# -- one entry, every output ----------------------------------------------------------------------------
def test_a_new_metric_is_computed_gated_rendered_and_documented_everywhere(tmp_path):
    rollout = np.zeros((4, 2), np.float32)
    trainer = np.array([[1e-6, 0], [0, 0], [0, 2e-4], [0, 0]], np.float32)
    with METRICS.scoped():
        METRICS.register(
            Metric(
                "frac_beyond_rounding",
                "fraction with `|Δlogp| > 1e-5`",
                lambda e: e.indicator(np.abs(e.delta) > 1e-5),
                scale="fraction",
                column="beyond",
                table_format=".4f",
            )
        )
        report = gate(rollout, trainer, profile="exact", thresholds={"frac_beyond_rounding": 0.3})
        check = next(c for c in report.verdict.checks if c.name == "frac_beyond_rounding")
        assert check.value == 1 / 8 and check.passed and check.limit == 0.3  # exact gates every step: 0.25 at step 1
        assert "frac_beyond_rounding" not in resolve_tolerance("kernel").limits  # a fraction: reported there
        assert report.metrics.by_sample[2].values.frac_beyond_rounding == 0.5
        data = json.loads(report.to_json())
        assert data["metrics"]["overall"]["frac_beyond_rounding"] == 0.125
        assert "beyond" in report.format_table() and "frac_beyond_rounding" in report.format_table()
        report.write_junit(tmp_path / "r.xml")
        names = {case.get("name") for case in ET.parse(tmp_path / "r.xml").iter("testcase")}
        assert "frac_beyond_rounding" in names
    assert "frac_beyond_rounding" not in METRICS


def test_a_new_statistic_reaches_json_and_junit(tmp_path):
    rollout = np.zeros((4, 2), np.float32)
    trainer = np.full((4, 2), 1e-4, np.float32)
    with STATISTICS.scoped():
        STATISTICS.register(Statistic("max_w", "max of `w`", lambda v: np.max(v.w, axis=-1), column="max_w"))
        report = gate(rollout, trainer, timesteps=np.tile(np.float32([900, 800]), (4, 1)))
        assert report.mismatch.overall.max_w == pytest.approx(math.exp(float(np.float32(1e-4))))
        assert [s.values.max_w for s in report.mismatch.by_timestep] == [report.mismatch.overall.max_w] * 2
        report.write_junit(tmp_path / "r.xml")
        props = {p.get("name") for p in ET.parse(tmp_path / "r.xml").iter("property")}
        assert {"mismatch.overall.max_w", "mismatch.t=900.max_w"} <= props
        assert "max_w" in report.format_table()


def test_a_new_profile_is_accepted_by_gate_and_the_checker_settings():
    strict = Profile(
        "kernel-strict",
        "half the kernel limits",
        limit=lambda metric, context: limit_by_scale(metric, bias=5e-5, spread=1.5e-4, max_=5e-4),
        basis=lambda context: "half the kernel limits",
    )
    rollout = np.zeros((8, 2), np.float32)
    trainer = np.full((8, 2), 7e-5, np.float32)  # inside kernel (1e-4), outside kernel-strict (5e-5)
    with PROFILES.scoped():
        PROFILES.register(strict)
        assert gate(rollout, trainer, profile="kernel").passed
        report = gate(rollout, trainer, profile="kernel-strict")
        assert not report.passed and report.tolerance.profile == "kernel-strict"
        assert "ppo_kl" in {c.name for c in report.verdict.checks if not c.passed}
        assert CheckConfig(profile="kernel-strict").resolved_profile == "kernel-strict"
        assert "kernel-strict" in table_profiles()
        assert decide(compute_metrics(rollout, trainer), resolve_tolerance("kernel-strict")).status == "FAIL"
    assert "kernel-strict" not in PROFILES


# -- the docs read the registries -------------------------------------------------------------------------
def test_the_docs_tables_are_the_registries():
    from pathlib import Path

    from rollout_consistency.gate.judging.metrics import metrics_table
    from rollout_consistency.gate.judging.mismatch import statistics_table

    checker = (Path(__file__).resolve().parents[1] / "docs" / "checker.md").read_text()
    assert metrics_table() in checker and statistics_table() in checker
    profiles = checker.split("## Tolerance profiles", 1)[1].split("\n\n", 3)[2]
    assert [row.split("|")[1].strip(" `") for row in profiles.splitlines()[2:]] == list(PROFILES)
