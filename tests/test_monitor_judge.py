"""The run monitor's judge: per-step verdict, gap / nonfinite / sync / drift alarms, bad series fail closed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollout_consistency.gate import TableSettings
from rollout_consistency.gate.monitor import MonitorError, MonitorSettings, StepJudge, StepStats


def _figures(rng: np.random.Generator, scale: float, n: int = 32, t: int = 4) -> object:
    rollout = rng.normal(-1.0, 0.1, (n, t)).astype(np.float32)
    trainer = (rollout + rng.normal(0.0, scale, rollout.shape)).astype(np.float32)
    return StepStats.from_tables(rollout, trainer).figures()


def _kernel(**changes: object) -> MonitorSettings:
    return MonitorSettings(gate=TableSettings(profile="kernel"), **changes)


def test_clean_steps_pass_and_the_floor_is_measured_over_the_first_k() -> None:
    rng = np.random.default_rng(0)
    judge = StepJudge(_kernel(warmup_steps=5))
    for step in range(30):
        verdict = judge.judge(step, _figures(rng, 1e-5))
        assert verdict.passed and not verdict.alarms, verdict
    summary = judge.summary()
    assert summary.passed and summary.steps_judged == 30
    assert summary.floor is not None and summary.floor.steps == (0, 1, 2, 3, 4)
    assert 5e-6 < summary.floor.value < 1.2e-5  # mean |N(0, 1e-5)| = 8e-6


def test_a_judge_that_saw_no_step_never_passes() -> None:
    summary = StepJudge().summary()
    assert not summary.passed
    assert "no step" in summary.reasons[0]


def test_steps_out_of_order_or_repeated_are_refused_and_gaps_alarm() -> None:
    rng = np.random.default_rng(1)
    judge = StepJudge(_kernel())
    judge.judge(3, _figures(rng, 1e-5))
    with pytest.raises(MonitorError, match="repeated"):
        judge.judge(3, _figures(rng, 1e-5))
    with pytest.raises(MonitorError, match="out of order"):
        judge.judge(2, _figures(rng, 1e-5))
    verdict = judge.judge(6, _figures(rng, 1e-5))
    assert [a.kind for a in verdict.alarms] == ["gap"]
    assert "2 step(s) between were not judged" in verdict.alarms[0].message
    assert not judge.summary().passed


def test_a_step_over_the_profile_fails_its_verdict_and_after_a_sync_names_the_sync() -> None:
    rng = np.random.default_rng(2)
    judge = StepJudge(_kernel())
    assert judge.judge(0, _figures(rng, 1e-5)).passed
    verdict = judge.judge(1, _figures(rng, 3e-3))
    assert not verdict.passed and [a.kind for a in verdict.alarms] == ["verdict"]
    judge.mark_sync()
    verdict = judge.judge(2, _figures(rng, 3e-3))
    assert [a.kind for a in verdict.alarms] == ["sync"] and verdict.after_sync
    assert "weight sync" in verdict.alarms[0].message
    judge.mark_sync()
    assert judge.judge(3, _figures(rng, 1e-5)).passed  # a clean step after a sync is no alarm


def test_nonfinite_steps_alarm() -> None:
    rollout = np.zeros((4, 2), np.float32) - 1
    trainer = np.full((4, 2), np.nan, np.float32)
    judge = StepJudge(_kernel())
    verdict = judge.judge(0, StepStats.from_tables(rollout, trainer).figures())
    assert not verdict.passed
    assert "nonfinite" in [a.kind for a in verdict.alarms]
    assert "8 NaN/inf" in verdict.alarms[0].message


def test_figures_without_a_gated_figure_are_refused() -> None:
    judge = StepJudge(_kernel())
    with pytest.raises(MonitorError, match="nothing would be compared"):
        judge.judge(0, {"chi2_seq": 0.0})
    verdict = judge.judge(0, {"mean_abs_dlogp": 1e-5, "ppo_kl": 0.0})  # a logged series with two figures
    assert verdict.passed and "max_abs_dlogp" in verdict.not_checked


def test_the_drift_alarm_fires_on_slow_growth_before_the_limit() -> None:
    rng = np.random.default_rng(3)
    judge = StepJudge(_kernel(warmup_steps=5))
    first_drift = first_verdict = None
    for step in range(100):
        scale = 1e-5 if step < 30 else 1e-5 * 1.1 ** (step - 30)  # +10 % a step from step 30
        verdict = judge.judge(step, _figures(rng, scale))
        kinds = [a.kind for a in verdict.alarms]
        if "drift" in kinds and first_drift is None:
            first_drift = step
        if "verdict" in kinds and first_verdict is None:
            first_verdict = step
    assert first_drift is not None and 30 < first_drift < 80
    assert first_verdict is None or first_drift < first_verdict


def test_leaving_a_bit_exact_floor_is_a_drift_at_once() -> None:
    judge = StepJudge(_kernel(warmup_steps=3))
    for step in range(3):
        assert judge.judge(step, {"mean_abs_dlogp": 0.0, "max_abs_dlogp": 0.0}).passed
    verdict = judge.judge(3, {"mean_abs_dlogp": 1e-7, "max_abs_dlogp": 1e-7})
    assert verdict.passed and [a.kind for a in verdict.alarms] == ["drift"]
    assert "bit-exact" in verdict.alarms[0].message and judge.floor.exact


def test_settings_are_checked() -> None:
    with pytest.raises(MonitorError, match="on_alarm"):
        MonitorSettings(on_alarm="ignore")
    with pytest.raises(MonitorError, match="warmup_steps"):
        MonitorSettings(warmup_steps=0)
    with pytest.raises(MonitorError, match="drift_figure"):
        MonitorSettings(drift_figure="nope")
    settings = MonitorSettings().replace(profile="kernel", warmup_steps=3)
    assert settings.gate.profile == "kernel" and settings.warmup_steps == 3
    with pytest.raises(TypeError, match="unknown monitor setting"):
        MonitorSettings().replace(nope=1)
    assert math.isnan(StepJudge().judge(0, {"ppo_kl": math.nan}).checks["ppo_kl"][0])
