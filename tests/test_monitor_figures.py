"""The run monitor's per-step figures: exact sums, shards merged bit for bit, the same figures as the gate's."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from rollout_consistency.gate import gate
from rollout_consistency.gate.monitor import (
    ExactSum,
    MonitorError,
    MonitorSettings,
    StepStats,
    StepStatsError,
    figures_from_scalars,
)
from rollout_consistency.gate.monitor.figures import label_timestep, timestep_label


def _tables(seed: int, n: int = 64, t: int = 6, scale: float = 3e-5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rollout = rng.normal(-1.0, 0.1, (n, t)).astype(np.float32)
    trainer = (rollout + rng.normal(0.0, scale, rollout.shape)).astype(np.float32)
    timesteps = np.tile(np.linspace(1000.0, 200.0, t, dtype=np.float32), (n, 1))
    return rollout, trainer, timesteps


@pytest.mark.parametrize("scale", [1e-5, 1.0, 1e300, 1e-310])
def test_exact_sum_is_the_exact_sum_rounded_once(scale: float) -> None:
    values = np.random.default_rng(1).normal(0.0, scale, 4099)
    exact = sum((Fraction(v) for v in values.tolist()), Fraction(0))
    total = ExactSum.of(values)
    assert total.value == float(exact) == math.fsum(values.tolist())
    assert total.mean(7) == float(exact / 7)
    assert ExactSum.of(values[:1000]) + ExactSum.of(values[1000:]) == total
    assert ExactSum.from_text(total.to_text()) == total
    groups = np.random.default_rng(2).integers(0, 5, values.size)
    for g, part in enumerate(ExactSum.grouped(values, groups, 5)):
        assert part.value == math.fsum(values[groups == g].tolist())


def test_the_few_values_path_and_the_vectorised_path_give_the_same_integer() -> None:
    values = np.random.default_rng(3).normal(0.0, 1e-6, 200)  # below the Python path's threshold ...
    padded = np.concatenate([values, np.zeros(300)])  # ... and above it: the vectorised split
    assert ExactSum.of(values) == ExactSum.of(padded)
    assert ExactSum.each([values, values[:7]]) == [ExactSum.of(values), ExactSum.of(values[:7])]


def test_exact_sum_keeps_infinities_apart() -> None:
    assert ExactSum.of(np.array([1.0, np.inf])).value == math.inf
    assert math.isnan(ExactSum.of(np.array([np.inf, -np.inf])).value)
    assert ExactSum.of(np.array([])).value == 0.0
    assert math.isnan(ExactSum().mean(0))


def test_shards_merge_to_the_whole_batch_bit_for_bit_in_any_order() -> None:
    rollout, trainer, timesteps = _tables(0, n=97)
    whole = StepStats.from_tables(rollout, trainer, timesteps=timesteps)
    cuts = [0, 13, 40, 41, 97]
    shards = [
        StepStats.from_tables(rollout[a:b], trainer[a:b], timesteps=timesteps[a:b]) for a, b in itertools.pairwise(cuts)
    ]
    for order in (shards, shards[::-1], [shards[2], shards[0], shards[3], shards[1]]):
        merged = order[0].merge(*order[1:])
        assert merged.figures() == whole.figures()  # every figure and every timestep's, bit for bit
    round_trip = StepStats.from_dict(whole.to_dict())
    assert round_trip.figures() == whole.figures()


def test_figures_are_the_gates_and_verls_on_the_same_tables() -> None:
    rollout, trainer, timesteps = _tables(3)
    figures = StepStats.from_tables(rollout, trainer, timesteps=timesteps).figures()
    report = gate(rollout, trainer, profile="kernel", timesteps=timesteps)
    overall, mismatch = report.metrics.overall, report.mismatch.overall
    # Full tables, one micro-batch: the gate's per-cell means pool to the same means (other summation order).
    for name in ("mean_abs_dlogp", "ppo_kl", "approx_kl", "ratio_mean", "pg_clipfrac_higher", "pg_clipfrac_lower"):
        assert figures.values[name] == pytest.approx(overall.get(name), rel=1e-12, abs=1e-18), name
    assert figures.values["max_abs_dlogp"] == overall.get("max_abs_dlogp")
    for name in ("k3_kl", "chi2_token", "chi2_seq", "bias", "ppl_ratio", "log_ppl_diff", "log_ppl_abs_diff"):
        assert figures.values[name] == pytest.approx(mismatch.get(name), rel=1e-9, abs=1e-18), name
    assert figures.values["ppo_kl"] == pytest.approx(mismatch.get("kl"), rel=1e-12)
    # verl-omni's per-timestep |Δlogp|: grouped by the timestep's value.
    for t, row in figures.by_timestep.items():
        column = np.flatnonzero(timesteps[0] == np.float32(t))
        expected = np.abs(trainer[:, column].astype(np.float64) - rollout[:, column]).mean()
        assert row["mean_abs_dlogp"] == pytest.approx(expected, rel=1e-12)
    scalars = figures.scalars()
    # verl's names under the monitor's prefix: never the trainer's own bare rollout_corr/* series
    assert scalars["monitor/rollout_corr/logprob_abs_diff_mean"] == figures.values["mean_abs_dlogp"]
    assert "monitor/rollout_corr/logprob_abs_diff/ts_1000" in scalars
    assert not any(name.startswith("rollout_corr/") for name in scalars)
    assert figures_from_scalars(scalars)["mean_abs_dlogp"] == figures.values["mean_abs_dlogp"]


def test_timestep_names_are_verl_omnis_and_mlflow_takes_them(tmp_path, monkeypatch) -> None:
    """verl-omni names a timestep ``f"{t:.4g}"``; ours is that less the exponent's ``+`` (MLflow refuses it).
    Timesteps equal to 4 digits share one series: their entry-weighted mean and their max."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    for t in (1000.0, 750.0, 999.5, 0.25, 1e-5, 12345.0):
        assert label_timestep(timestep_label(t)) == float(f"{t:.4g}")
        assert timestep_label(t) == f"{t:.4g}".replace("e+", "e")
    assert timestep_label(12345.0) == "1.234e04"
    assert label_timestep("1.234e+04") == 12340.0  # verl-omni's own, read back
    rollout = np.full((2, 3), -1.0, np.float32)
    trainer = rollout + np.array([[1e-3, 2e-3, 4e-3], [1e-3, 2e-3, 8e-3]], np.float32)
    timesteps = np.array([[12341.0, 12342.0, 800.0], [12341.0, 12341.0, 800.0]], np.float32)
    scalars = StepStats.from_tables(rollout, trainer, timesteps=timesteps).figures().scalars()
    shared = scalars["monitor/rollout_corr/logprob_abs_diff/ts_1.234e04"]  # 12341 and 12342: one label
    assert shared == pytest.approx((1e-3 + 1e-3 + 2e-3 + 2e-3) / 4, rel=1e-4)
    assert scalars["monitor/max_abs_dlogp_per_ts/ts_1.234e04"] == pytest.approx(2e-3, rel=1e-4)
    assert not any("+" in name for name in scalars)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=f"file:{tmp_path / 'mlruns'}")
    run = client.create_run("0")
    client.log_batch(run.info.run_id, metrics=[Metric(k, v, 0, 1) for k, v in scalars.items()])  # none refused
    with pytest.raises(StepStatsError, match="need a prefix"):
        StepStats.from_tables(rollout, trainer).figures().scalars("")
    for prefix in ("", "/", "monitor"):
        with pytest.raises(MonitorError, match="give a non-empty prefix ending in '/'"):
            MonitorSettings(prefix=prefix)


def test_timesteps_are_grouped_by_value_when_windows_differ_per_sample() -> None:
    rollout, trainer, _ = _tables(4, n=8, t=2)
    timesteps = np.array([[800.0, 700.0], [700.0, 600.0]] * 4, dtype=np.float32)
    rows = StepStats.from_tables(rollout, trainer, timesteps=timesteps).figures().by_timestep
    assert sorted(rows) == [600.0, 700.0, 800.0]
    assert rows[700.0]["entries"] == 8.0
    expected = np.abs(trainer.astype(np.float64) - rollout)[timesteps == 700.0].mean()
    assert rows[700.0]["mean_abs_dlogp"] == pytest.approx(expected, rel=1e-12)


def test_nonfinite_entries_are_counted_and_never_averaged_away() -> None:
    rollout, trainer, timesteps = _tables(5)
    trainer[3, 2] = np.nan
    figures = StepStats.from_tables(rollout, trainer, timesteps=timesteps).figures()
    assert figures.nonfinite == 1
    assert all(math.isnan(v) for v in figures.values.values())
    t = float(timesteps[3, 2])
    assert math.isnan(figures.by_timestep[t]["mean_abs_dlogp"])
    all_nan = StepStats.from_tables(rollout, np.full_like(trainer, np.nan)).figures()
    assert all_nan.nonfinite == trainer.size and math.isnan(all_nan.values["ppo_kl"])


def test_masked_entries_are_left_out() -> None:
    rollout, trainer, _ = _tables(6, n=4, t=3)
    mask = np.array([[1, 1, 0]] * 4, dtype=bool)
    masked = StepStats.from_tables(rollout, trainer, mask=mask).figures()
    cut = StepStats.from_tables(rollout[:, :2].copy(), trainer[:, :2].copy()).figures()
    assert masked.entries == 8
    assert masked.values["mean_abs_dlogp"] == cut.values["mean_abs_dlogp"]


def test_bad_tables_are_refused_naming_the_fix() -> None:
    rollout, trainer, _ = _tables(7, n=4, t=3)
    with pytest.raises(StepStatsError, match="same memory"):
        StepStats.from_tables(rollout, rollout)  # verl-omni's bypass mode: old_log_probs := rollout_log_probs
    with pytest.raises(StepStatsError, match="shape"):
        StepStats.from_tables(rollout, trainer[:, :2])
    with pytest.raises(StepStatsError, match="dtype"):
        StepStats.from_tables(rollout.astype(np.float16), trainer)
    with pytest.raises(StepStatsError, match="timesteps"):
        StepStats.from_tables(rollout, trainer, timesteps=np.full(rollout.shape, np.nan, np.float32))
    a = StepStats.from_tables(rollout, trainer, clip_ratio=1e-4)
    with pytest.raises(StepStatsError, match="clip"):
        a.merge(StepStats.from_tables(rollout, trainer, clip_ratio=1e-3))
    with pytest.raises(StepStatsError, match="not a StepStats"):
        StepStats.from_dict({"entries": 1})
    assert StepStats.from_tables(rollout[:0], trainer[:0]).figures().entries == 0
