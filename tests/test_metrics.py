"""rollout_consistency.gate.judging.metrics: formulas against hand-computed values, trainer aggregation, fail-closed inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_consistency.gate.judging.metrics import (
    METRIC_NAMES,
    ConsistencyMetrics,
    MetricsInputError,
    compute_metrics,
)

f32 = np.float32


def col(*values):
    """A (B, 1) float32 table."""
    return np.array(values, dtype=np.float32).reshape(-1, 1)


def test_all_equal_is_perfect_agreement():
    logp = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    m = compute_metrics(logp, logp.clone(), clip_ratio=1e-5)
    o = m.overall
    assert (o.ratio_mean, o.ratio_std, o.ppo_kl, o.approx_kl) == (1.0, 0.0, 0.0, 0.0)
    assert (o.pg_clipfrac, o.pg_clipfrac_higher, o.pg_clipfrac_lower) == (0.0, 0.0, 0.0)
    assert (o.mean_abs_dlogp, o.max_abs_dlogp, o.count) == (0.0, 0.0, 18)
    assert not m.nonfinite and not m.missing and not m.empty_samples


def test_one_outlier_by_hand():
    d = float(f32(math.log(1.5)))  # the float32 log-prob difference, exactly
    m = compute_metrics(col(0, 0, 0, 0), col(0, 0, 0, d), clip_ratio=1e-4)
    o = m.overall
    ratios = [1.0, 1.0, 1.0, math.exp(d)]
    mean = sum(ratios) / 4
    assert o.ratio_mean == pytest.approx(mean, rel=1e-15)
    assert o.ratio_std == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in ratios) / 4), rel=1e-14)
    assert o.ppo_kl == pytest.approx(-d / 4, rel=1e-15)
    assert o.approx_kl == pytest.approx(d * d / 8, rel=1e-15)
    assert (o.pg_clipfrac, o.pg_clipfrac_higher, o.pg_clipfrac_lower) == (0.25, 0.25, 0.0)
    assert o.mean_abs_dlogp == pytest.approx(d / 4, rel=1e-15) and o.max_abs_dlogp == d
    assert m.by_sample[3].values.ppo_kl == -d and m.by_sample[0].values.max_abs_dlogp == 0


def test_delta_is_exact_in_float64():
    rollout = col(f32(1.0) + np.finfo(np.float32).eps)  # 1 + 2^-23
    m = compute_metrics(rollout, col(1.0))
    assert m.overall.ppo_kl == 2.0**-23 and m.overall.max_abs_dlogp == 2.0**-23


def test_clip_sides_and_asymmetric_ranges():
    up, down = float(f32(2e-3)), float(f32(-2e-3))
    m = compute_metrics(col(0, 0, 0, 0), col(up, down, down, 0), clip_ratio=1e-3)
    assert (m.overall.pg_clipfrac, m.overall.pg_clipfrac_higher, m.overall.pg_clipfrac_lower) == (0.75, 0.25, 0.5)
    # verl's clip_ratio_low/high: a wider low side stops counting the downward ones.
    m = compute_metrics(col(0, 0, 0, 0), col(up, down, down, 0), clip_ratio=1e-3, clip_ratio_low=1e-2)
    assert (m.overall.pg_clipfrac, m.overall.pg_clipfrac_higher, m.overall.pg_clipfrac_lower) == (0.25, 0.25, 0.0)
    assert (m.clip_ratio_low, m.clip_ratio_high) == (1e-2, 1e-3)


def test_micro_batch_cells_are_averaged_unweighted_like_a_trainer_log():
    a, b = float(f32(3e-4)), float(f32(-6e-4))
    rollout = np.zeros((3, 1), dtype=np.float32)
    trainer = col(a, 0, b)
    # Micro-batches {0, 1} and {2}: ppo_kl = mean(-(a + 0) / 2, -b), not the per-sample mean.
    m = compute_metrics(rollout, trainer, micro_batch_size=2)
    assert m.overall.ppo_kl == pytest.approx(((-a / 2) + (-b)) / 2, rel=1e-15)
    assert m.overall.ratio_std == pytest.approx(abs(math.exp(a) - 1) / 2 / 2, rel=1e-12)  # cell {2} has std 0
    whole = compute_metrics(rollout, trainer)
    assert whole.overall.ppo_kl == pytest.approx(-(a + b) / 3, rel=1e-15)
    assert m.overall.max_abs_dlogp == whole.overall.max_abs_dlogp == abs(b)  # a max, not a mean of maxima


def test_steps_average_over_window_positions():
    rollout = np.zeros((2, 2), dtype=np.float32)
    trainer = np.array([[1e-3, 0], [1e-3, 0]], dtype=np.float32)
    m = compute_metrics(rollout, trainer)
    assert m.by_position[0].values.ppo_kl == -float(f32(1e-3))
    assert m.by_position[1].values.ppo_kl == 0
    assert m.overall.ppo_kl == pytest.approx(-float(f32(1e-3)) / 2, rel=1e-15)


def test_by_timestep_follows_exact_values_when_windows_differ():
    rollout = np.zeros((2, 2), dtype=np.float32)
    trainer = np.array([[1e-4, 2e-4], [3e-4, 4e-4]], dtype=np.float32)
    steps = np.array([[900, 800], [800, 700]], dtype=np.float32)
    m = compute_metrics(rollout, trainer, timesteps=steps)
    assert [(s.timestep, s.position) for s in m.by_timestep] == [(900.0, 0), (800.0, None), (700.0, 1)]
    t800 = m.by_timestep[1].values
    assert t800.count == 2 and t800.ppo_kl == pytest.approx(-(float(f32(2e-4)) + float(f32(3e-4))) / 2, rel=1e-15)
    assert [s.timestep for s in m.by_position] == [None, None]  # each position holds two timesteps


@pytest.mark.parametrize(
    "value, ratio_mean, ppo_kl, clip_hi, clip_lo",
    [(math.inf, math.inf, -math.inf, 0.5, 0.0), (-math.inf, 0.5, math.inf, 0.0, 0.5)],
)
def test_infinite_log_probs_propagate_and_are_flagged(value, ratio_mean, ppo_kl, clip_hi, clip_lo):
    m = compute_metrics(col(0, 0), col(0, value))
    o = m.overall
    assert o.ratio_mean == ratio_mean and o.ppo_kl == ppo_kl
    assert (o.pg_clipfrac_higher, o.pg_clipfrac_lower) == (clip_hi, clip_lo)
    assert o.max_abs_dlogp == math.inf and not o.is_finite()
    assert [(e.sample, e.side, e.value) for e in m.nonfinite] == [(1, "trainer", "inf" if value > 0 else "-inf")]


def test_nan_is_never_averaged_away():
    m = compute_metrics(col(0, 0, 0, 0), col(0, 0, 0, math.nan))
    for name in METRIC_NAMES:
        assert math.isnan(m.overall.get(name)), name  # clip fractions too: a NaN ratio is not "unclipped"
    assert math.isnan(m.by_position[0].values.pg_clipfrac)
    assert m.by_sample[0].values.is_finite() and not m.by_sample[3].values.is_finite()
    assert m.nonfinite[0].value == "nan"


def test_both_sides_infinite_gives_nan_and_two_flags():
    m = compute_metrics(col(-math.inf), col(-math.inf))
    assert math.isnan(m.overall.ppo_kl)
    assert {e.side for e in m.nonfinite} == {"rollout", "trainer"}


def test_masks_report_missing_steps_and_empty_samples():
    rollout = np.zeros((3, 2), dtype=np.float32)
    trainer = np.full((3, 2), 5e-4, dtype=np.float32)
    r_mask = np.array([[1, 1], [1, 0], [0, 0]], dtype=bool)
    t_mask = np.array([[1, 0], [1, 0], [0, 0]], dtype=bool)
    m = compute_metrics(rollout, trainer, masks=(r_mask, t_mask))
    assert [(x.sample, x.position, x.missing_on) for x in m.missing] == [(0, 1, "trainer")]
    assert m.empty_samples == (2,)
    assert m.overall.count == 2  # only the steps both sides have
    # Masked-out entries never count as non-finite.
    trainer[2, :] = np.nan
    assert not compute_metrics(rollout, trainer, masks=(r_mask, t_mask)).nonfinite


def test_empty_batch_gives_nan_figures_and_zero_count():
    m = compute_metrics(np.zeros((0, 2), np.float32), np.zeros((0, 2), np.float32))
    assert m.overall.count == 0 and math.isnan(m.overall.ratio_mean) and m.by_position == ()


@pytest.mark.parametrize(
    "rollout, trainer, match",
    [
        (np.zeros((2, 3), np.float32), np.zeros((2, 2), np.float32), "shape"),
        (np.zeros(3, np.float32), np.zeros(3, np.float32), "must be 2-D"),
        (np.zeros((2, 2), np.float16), np.zeros((2, 2), np.float16), "float32"),
        (torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2), "float32"),
        (np.zeros((2, 2), np.int64), np.zeros((2, 2), np.float32), "float32"),
    ],
)
def test_bad_inputs_are_usage_errors(rollout, trainer, match):
    with pytest.raises(MetricsInputError, match=match):
        compute_metrics(rollout, trainer)


def test_bad_settings_are_usage_errors():
    z = np.zeros((1, 1), np.float32)
    with pytest.raises(MetricsInputError, match="micro_batch_size"):
        compute_metrics(z, z, micro_batch_size=0)
    with pytest.raises(MetricsInputError, match="clip_ratio_low"):
        compute_metrics(z, z, clip_ratio_low=-1.0)
    with pytest.raises(MetricsInputError, match="rollout_mask"):
        compute_metrics(z, z, masks=(np.ones((2, 1), bool), None))


def test_masks_are_read_alike_by_the_metrics_and_the_monitor():
    """One reading of a mask (judging.views.flag_table) for compute_metrics and the monitor's StepStats: bool or 0/1
    of the tables' shape, a 0/1 float mask used as flags; anything else refused, naming the argument."""
    from rollout_consistency.gate.monitor import StepStats, StepStatsError

    rollout = np.zeros((2, 3), np.float32)
    trainer = np.full((2, 3), 1e-3, np.float32)
    flags = np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]], np.float32)
    assert compute_metrics(rollout, trainer, masks=(torch.from_numpy(flags), None)).overall.count == 4
    assert StepStats.from_tables(rollout, trainer, mask=torch.from_numpy(flags)).entries == 4
    for bad, words in ((flags * 2, "must hold booleans"), (flags[:, :2], "one flag per entry")):
        with pytest.raises(MetricsInputError, match=f"^`rollout_mask` .*{words}"):
            compute_metrics(rollout, trainer, masks=(bad, None))
        with pytest.raises(StepStatsError, match=f"^mask .*{words}"):
            StepStats.from_tables(rollout, trainer, mask=bad)


def test_round_trips_through_dict():
    rollout = np.zeros((4, 2), np.float32)
    trainer = np.array([[1e-4, math.nan], [0, 2e-4], [0, 0], [-1e-4, 0]], np.float32)
    m = compute_metrics(rollout, trainer, micro_batch_size=2, timesteps=np.tile(np.float32([900, 800]), (4, 1)))
    again = ConsistencyMetrics.from_dict(m.to_dict())
    assert again.to_dict().keys() == m.to_dict().keys()
    assert again.nonfinite == m.nonfinite and again.by_position[0] == m.by_position[0]


def _reference(rollout, trainer, mbs, eps):
    """Independent plain-Python version of the trainer's loop: for step j, for each micro-batch: log."""
    b, w = rollout.shape
    logs = {k: [] for k in ("ratio_mean", "ratio_std", "ppo_kl", "clip", "approx_kl")}
    for j in range(w):
        for start in range(0, b, mbs):
            d = [float(trainer[i, j]) - float(rollout[i, j]) for i in range(start, min(b, start + mbs))]
            r = [math.exp(x) for x in d]
            mu = sum(r) / len(r)
            logs["ratio_mean"].append(mu)
            logs["ratio_std"].append(math.sqrt(sum((x - mu) ** 2 for x in r) / len(r)))
            logs["ppo_kl"].append(sum(-x for x in d) / len(d))
            logs["clip"].append(sum(abs(x - 1) > eps for x in r) / len(r))
            logs["approx_kl"].append(0.5 * sum(x * x for x in d) / len(d))
    return {k: sum(v) / len(v) for k, v in logs.items()}


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 7),
    width=st.integers(1, 4),
    mbs=st.integers(1, 8),
    seed=st.integers(0, 10_000),
    scale=st.sampled_from([1e-6, 1e-4, 1e-2]),
)
def test_matches_an_independent_trainer_loop(batch, width, mbs, seed, scale):
    rng = np.random.default_rng(seed)
    rollout = rng.normal(size=(batch, width)).astype(np.float32)
    trainer = (rollout + rng.normal(scale=scale, size=(batch, width))).astype(np.float32)
    m = compute_metrics(rollout, trainer, clip_ratio=1e-4, micro_batch_size=mbs)
    ref = _reference(rollout, trainer, mbs, 1e-4)
    o = m.overall
    assert o.ratio_mean == pytest.approx(ref["ratio_mean"], rel=1e-13)
    assert o.ratio_std == pytest.approx(ref["ratio_std"], rel=1e-9, abs=1e-15)
    assert o.ppo_kl == pytest.approx(ref["ppo_kl"], rel=1e-12, abs=1e-18)
    assert o.pg_clipfrac == pytest.approx(ref["clip"], abs=1e-15)
    assert o.approx_kl == pytest.approx(ref["approx_kl"], rel=1e-12)


@pytest.mark.parametrize("side", ["higher", "lower"])
def test_clip_fractions_count_strictly_beyond_the_clip_range(side):
    """A ratio exactly on 1 ± ε is not clipped: trainers count `ratio − 1 > ε` and `1 − ratio > ε`, not `>=`."""
    d = float(np.float32(3e-4)) * (1 if side == "higher" else -1)
    rollout, trainer = col(0), col(d)
    ratio = compute_metrics(rollout, trainer).overall.ratio_mean  # exp(Δ) as the metrics compute it: one entry
    eps = ratio - 1.0 if side == "higher" else 1.0 - ratio  # exact (Sterbenz): the ratio sits on 1 ± ε
    on = compute_metrics(rollout, trainer, clip_ratio=eps).overall
    assert (on.pg_clipfrac, on.pg_clipfrac_higher, on.pg_clipfrac_lower) == (0.0, 0.0, 0.0)
    beyond = compute_metrics(rollout, trainer, clip_ratio=float(np.nextafter(eps, 0.0))).overall
    assert beyond.pg_clipfrac == 1.0 and getattr(beyond, f"pg_clipfrac_{side}") == 1.0
