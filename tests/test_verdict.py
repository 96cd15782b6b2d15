"""rollout_consistency.gate.judging.tolerances + rollout_consistency.gate.judging.verdict: profiles, overrides, and the fail-closed guards."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollout_consistency.gate.judging.metrics import METRIC_NAMES, compute_metrics
from rollout_consistency.gate.judging.tolerances import (
    KERNEL_MAX_LIMIT,
    KERNEL_MEAN_LIMIT,
    RMS_TO_MEAN,
    ToleranceError,
    calibrated_tolerance,
    exact_tolerance,
    kernel_tolerance,
    resolve_tolerance,
)
from rollout_consistency.gate.judging.verdict import GUARD_CHECKS, Problem, Verdict, bias_standard_error, decide

STEPS = np.tile(np.float32([900, 750, 500]), (8, 1))


def tables(bias=0.0, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rollout = rng.normal(size=(8, 3)).astype(np.float32)
    trainer = (rollout.astype(np.float64) + bias + rng.normal(scale=noise, size=rollout.shape)).astype(np.float32)
    if noise == 0 and bias == 0:
        trainer = rollout.copy()
    return rollout, trainer


def failed(verdict: Verdict) -> set[str]:
    return {c.name for c in verdict.checks if not c.passed}


def test_exact_passes_identical_log_probs_with_every_check_listed():
    rollout, trainer = tables()
    verdict = decide(compute_metrics(rollout, trainer, timesteps=STEPS), exact_tolerance())
    assert verdict.passed and verdict.status == "PASS" and verdict.reasons == ()
    assert [c.name for c in verdict.checks] == list(GUARD_CHECKS) + list(METRIC_NAMES)


def test_exact_fails_on_one_ulp_and_names_the_step():
    rollout, trainer = tables()
    trainer[3, 1] = np.nextafter(trainer[3, 1], np.float32(np.inf))
    verdict = decide(compute_metrics(rollout, trainer, timesteps=STEPS), exact_tolerance())
    assert not verdict.passed
    assert {"max_abs_dlogp", "ppo_kl", "ratio_mean", "approx_kl"} <= failed(verdict)
    check = next(c for c in verdict.checks if c.name == "max_abs_dlogp")
    assert check.steps == (1,) and check.timesteps == (750.0,)
    assert "step 1 t=750" in check.message and check.excess > 0
    assert not any(c.kind == "guard" and not c.passed for c in verdict.checks)


def test_kernel_profile_passes_noise_below_the_floor_and_fails_a_bias():
    rollout, trainer = tables(noise=1e-5)
    assert decide(compute_metrics(rollout, trainer, timesteps=STEPS), kernel_tolerance()).passed
    rollout, trainer = tables(bias=-2.5e-4)
    verdict = decide(compute_metrics(rollout, trainer, timesteps=STEPS), kernel_tolerance())
    # A bias fails the bias gates (1e-4) before the spread gate (3e-4) of a zero-mean kernel noise.
    assert {"ppo_kl", "ratio_mean"} <= failed(verdict) and "mean_abs_dlogp" not in failed(verdict)
    check = next(c for c in verdict.checks if c.name == "ppo_kl")
    assert check.limit == KERNEL_MEAN_LIMIT and "2.5x the limit" in check.message
    assert check.steps == (0, 1, 2)


def test_kernel_profile_limits_follow_the_published_floor():
    limits = kernel_tolerance().limits
    assert limits["ppo_kl"] == KERNEL_MEAN_LIMIT == 1e-4 and limits["max_abs_dlogp"] == KERNEL_MAX_LIMIT == 1e-3
    assert limits["approx_kl"] == pytest.approx(0.5 * (RMS_TO_MEAN * 3e-4) ** 2)  # rms <= 2x the mean-type limit
    assert "pg_clipfrac" not in limits  # reported, not gated


def test_nan_fails_even_if_every_metric_gate_is_loose():
    rollout, trainer = tables()
    trainer[0, 0] = np.nan
    loose = resolve_tolerance("kernel", {m: 1e9 for m in METRIC_NAMES})
    verdict = decide(compute_metrics(rollout, trainer), loose)
    assert "finite" in failed(verdict)
    assert "sample 0 step 0 trainer=nan" in " ".join(verdict.reasons)


@pytest.mark.parametrize("profile", ["exact", "kernel"])
def test_a_nan_figure_fails_its_own_check_not_only_the_finite_guard(profile):
    rollout, trainer = tables()
    trainer[0, 0] = np.nan
    loose = resolve_tolerance(profile, {m: 1e9 for m in METRIC_NAMES})
    verdict = decide(compute_metrics(rollout, trainer), loose)
    metric_checks = [c for c in verdict.checks if c.kind == "metric"]
    assert len(metric_checks) == len(METRIC_NAMES)
    for check in metric_checks:  # every figure is NaN (a NaN ratio's clip indicator too): none is within a limit
        assert not check.passed and "not a number" in check.message, check.name
        assert math.isnan(check.excess)


def test_bias_standard_error_is_the_sample_standard_deviation_over_root_n():
    d = np.float32([1, 2, 3, 4]) * np.float32(2**-10)
    m = compute_metrics(np.zeros((4, 2), np.float32), np.repeat(d[:, None], 2, axis=1))
    # per-sample ppo_kl -d: mean -2.5·2^-10, squared deviations (1.5² + 0.5² + 0.5² + 1.5²)·2^-20 = 5·2^-20 over n - 1 = 3
    assert bias_standard_error("ppo_kl", m) == pytest.approx(math.sqrt(5 / 3 / 4) * 2**-10, rel=1e-14)
    assert (
        bias_standard_error("ppo_kl", compute_metrics(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float32))) == 0
    )


@pytest.mark.parametrize("dlogp", [400.0, 700.0])
def test_a_bias_allowance_beyond_float64_squares_is_computed_not_raised(dlogp):
    # Per-sample ratio means near exp(400)..exp(700): their squared deviations overflow a float (a bare
    # OverflowError was exit 2 with no doctor). The allowance is the same figure on the scaled values.
    rollout = np.zeros((8, 2), np.float32)
    trainer = np.repeat(np.float32([dlogp, dlogp - 1, dlogp - 2, dlogp - 3, 0, 0, 0, 0])[:, None], 2, axis=1)
    m = compute_metrics(rollout, trainer)
    figures = [s.values.get("ratio_mean") for s in m.by_sample]
    scale = max(figures)
    scaled = [f / scale for f in figures]
    mean = sum(scaled) / 8
    expected = scale * math.sqrt(sum((f - mean) ** 2 for f in scaled) / 7 / 8)
    assert math.isfinite(expected) and bias_standard_error("ratio_mean", m) == pytest.approx(expected, rel=1e-12)
    verdict = decide(m, kernel_tolerance())
    assert not verdict.passed and {"ratio_std", "mean_abs_dlogp", "max_abs_dlogp"} <= failed(verdict)


def test_an_allowance_whose_sum_overflows_is_scaled_not_infinite():
    # Per-sample ratio means near float64's largest: their sum is inf, so an unscaled mean would give an infinite
    # allowance, and an infinite ratio_mean within "limit + inf" would pass its own check.
    rollout = np.zeros((8, 2), np.float32)
    trainer = np.full((8, 2), 709.0, np.float32)
    trainer[::2, 1] = 700.0
    m = compute_metrics(rollout, trainer)
    assert math.isinf(sum(s.values.get("ratio_mean") for s in m.by_sample))
    error = bias_standard_error("ratio_mean", m)
    assert math.isfinite(error) and error > 0
    check = next(c for c in decide(m, kernel_tolerance()).checks if c.name == "ratio_mean")
    assert not check.passed


def test_infinite_figures_fail_the_finite_guard():
    rollout, trainer = tables()
    trainer[2, 2] = -np.inf
    verdict = decide(compute_metrics(rollout, trainer), kernel_tolerance())
    assert {"finite", "ppo_kl", "max_abs_dlogp"} <= failed(verdict)


def test_empty_batch_fails():
    z = np.zeros((0, 3), np.float32)
    verdict = decide(compute_metrics(z, z), exact_tolerance())
    assert "nonempty" in failed(verdict) and not verdict.passed
    assert all("not evaluated" in c.message for c in verdict.checks if c.kind == "metric")


def test_missing_step_fails_even_when_the_rest_agrees():
    rollout, trainer = tables()
    mask = np.ones_like(rollout, dtype=bool)
    mask[5, 2] = False
    verdict = decide(compute_metrics(rollout, trainer, masks=(None, mask)), exact_tolerance())
    assert failed(verdict) == {"complete"}
    assert "sample 5 step 2 (missing on trainer)" in verdict.reasons[0]


def test_pipeline_problems_fail_closed_without_metrics():
    verdict = decide(None, exact_tolerance(), [Problem("shapes", "rollout (4, 2) vs trainer (4, 3)")])
    assert not verdict.passed and "shapes" in failed(verdict)
    assert all(not c.passed for c in verdict.checks if c.kind == "metric")
    assert not decide(None, exact_tolerance()).passed  # no metrics and no reason: still a FAIL


def test_dead_worker_fails_naming_the_shard():
    rollout, trainer = tables()
    problem = Problem("workers", "shard 1 failed after 2 attempt(s): worker died")
    verdict = decide(compute_metrics(rollout, trainer), exact_tolerance(), [problem])
    assert failed(verdict) == {"workers"} and "shard 1" in verdict.reasons[0]


def test_unknown_pipeline_check_is_listed_and_fails():
    verdict = decide(compute_metrics(*tables()), exact_tolerance(), [Problem("calibration", "floor run died")])
    assert failed(verdict) == {"calibration"}


def test_a_check_that_gates_nothing_fails():
    off = resolve_tolerance("exact", {m: None for m in METRIC_NAMES})
    verdict = decide(compute_metrics(*tables()), off)
    assert failed(verdict) == {"gates"}


def test_overrides_change_and_remove_single_gates():
    tol = resolve_tolerance("exact", {"ppo_kl": 1e-3, "max_abs_dlogp": None})
    assert tol.limits["ppo_kl"] == 1e-3 and "max_abs_dlogp" not in tol.limits and tol.limits["approx_kl"] == 0
    assert tol.overridden == ("ppo_kl", "max_abs_dlogp")
    with pytest.raises(ToleranceError, match="Did you mean 'ppo_kl'"):
        resolve_tolerance("exact", {"ppo_kll": 1.0})
    with pytest.raises(ToleranceError, match=">= 0"):
        resolve_tolerance("exact", {"ppo_kl": -1.0})
    with pytest.raises(ToleranceError, match="Did you mean 'kernel'"):
        resolve_tolerance("kernal")


def test_calibrated_limits_are_multiples_of_the_measured_floor():
    rollout, trainer = tables(noise=3e-6)
    floor = compute_metrics(rollout, trainer).overall
    tol = calibrated_tolerance(floor, multiple=4)
    assert tol.limits["max_abs_dlogp"] == 4 * floor.max_abs_dlogp
    assert tol.limits["mean_abs_dlogp"] == 4 * floor.mean_abs_dlogp
    assert tol.limits["ppo_kl"] >= 4 * floor.mean_abs_dlogp  # never 0 because a signed mean cancelled
    assert tol.limits["approx_kl"] == 16 * floor.approx_kl
    # The same kind of noise passes; a bias 10x the floor fails.
    assert decide(compute_metrics(*tables(noise=3e-6, seed=1)), tol).passed
    assert not decide(compute_metrics(*tables(bias=10 * floor.mean_abs_dlogp, seed=1)), tol).passed


def test_calibrated_floor_of_zero_degenerates_to_exact_and_bad_floors_refuse():
    zero = compute_metrics(*tables()).overall
    tol = calibrated_tolerance(zero)
    assert set(tol.limits.values()) == {0.0} and "bit for bit" in tol.basis
    rollout, trainer = tables()
    trainer[0, 0] = np.nan
    with pytest.raises(ToleranceError, match="not finite"):
        calibrated_tolerance(compute_metrics(rollout, trainer).overall)
    with pytest.raises(ToleranceError, match="needs the measured floor"):
        resolve_tolerance("calibrated")
    with pytest.raises(ToleranceError, match="multiple"):
        calibrated_tolerance(zero, multiple=0.5)


def test_bf16_latent_signature_is_reported_as_such():
    """ratio_mean < 1 with all clipping on the lower side (the bf16-latent signature) — the reasons say which metrics."""
    rollout, trainer = tables(bias=-4e-5, noise=1e-6)
    m = compute_metrics(rollout, trainer, clip_ratio=1e-5, timesteps=STEPS)
    assert m.overall.ratio_mean < 1 and m.overall.pg_clipfrac_higher == 0 and m.overall.pg_clipfrac_lower > 0.9
    verdict = decide(m, exact_tolerance())
    assert {"ratio_mean", "ppo_kl", "pg_clipfrac_lower"} <= failed(verdict)
    assert "pg_clipfrac_higher" not in failed(verdict)


def test_verdict_round_trips():
    rollout, trainer = tables(bias=1e-3)
    verdict = decide(compute_metrics(rollout, trainer, timesteps=STEPS), kernel_tolerance())
    assert Verdict.from_dict(verdict.to_dict()) == verdict
    assert math.isfinite(next(c for c in verdict.checks if c.name == "ppo_kl").excess)


# ---------------------------------------------------------------------------------------------------------------
# Guards a mutation run found untested (issue 30): each test below fails when its guard is removed.


def test_a_verdict_with_no_checks_is_not_a_pass():
    # A report read back with no checks (a truncated or hand-written JSON) judged nothing.
    assert not Verdict(()).passed and Verdict(()).status == "FAIL"
    assert not Verdict.from_dict({"checks": []}).passed


def test_finite_log_probs_whose_ratio_overflows_fail_the_finite_guard():
    # Every log-prob is finite, but exp(800) overflows float64: the ratio figures are inf and the guard names them.
    rollout, _ = tables()
    verdict = decide(compute_metrics(rollout, rollout + np.float32(800)), kernel_tolerance())
    finite = next(c for c in verdict.checks if c.name == "finite")
    assert not finite.passed and finite.message.startswith("figures not finite: ratio_mean, ratio_std")


def test_a_timestep_over_the_limit_fails_exact_when_every_window_position_is_within():
    # Windows start one step apart: position 0 holds timesteps 900 (+d) and 750 (-d), position 1 holds 750 (-d) and
    # 500 (+d). ppo_kl is 0 overall and at both positions, but not at any timestep: `exact` gates the timesteps too.
    d = np.float32(2**-10)
    rollout = np.zeros((2, 2), np.float32)
    trainer = np.array([[d, -d], [-d, d]], np.float32)
    steps = np.float32([[900, 750], [750, 500]])
    metrics = compute_metrics(rollout, trainer, timesteps=steps)
    assert metrics.overall.ppo_kl == 0 and all(s.values.ppo_kl == 0 for s in metrics.by_position)
    check = next(c for c in decide(metrics, exact_tolerance()).checks if c.name == "ppo_kl")
    assert not check.passed and check.timesteps == (900.0, 750.0, 500.0), check


def test_a_threshold_that_is_not_a_finite_number_is_refused():
    for bad in (math.nan, math.inf):
        with pytest.raises(ToleranceError, match="must be a finite number >= 0"):
            resolve_tolerance("kernel", {"ppo_kl": bad})


def test_tables_with_no_window_step_fail_as_empty_and_incomplete():
    # Three samples, zero window steps: nothing compared, and every sample named as having no step.
    z = np.zeros((3, 0), np.float32)
    metrics = compute_metrics(z, z)
    assert metrics.empty_samples == (0, 1, 2)
    assert {"nonempty", "complete"} <= failed(decide(metrics, exact_tolerance()))


def test_whole_number_timesteps_match_the_step_they_truncate_and_no_other():
    """DanceGRPO stores int(sigma * 1000): the plan's step it truncated matches, a neighbouring step or a
    fractional timestep off by the same amount does not."""
    from rollout_consistency.gate.judging.verdict import plan_window_problems

    plan = np.array([[1000.0, 826.0643, 617.4471, 381.9660]])
    table = np.zeros((1, 4))
    assert plan_window_problems("rollout", table, 4, [0], timesteps=np.trunc(plan), expected=plan) == []
    assert plan_window_problems("rollout", table, 4, [0], timesteps=np.round(plan), expected=plan) == []
    shifted = np.trunc(plan[:, [0, 0, 1, 2]])  # each step scored at the previous step's timestep
    assert "timesteps differ" in plan_window_problems("rollout", table, 4, [0], timesteps=shifted, expected=plan)[0]
    fractional = plan - 0.5
    assert "4 of 4" in plan_window_problems("trainer", table, 4, [0], timesteps=fractional, expected=plan)[0]
