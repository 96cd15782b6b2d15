"""The vectorised judging (rollout_consistency.gate.judging.views and the registries) gives every figure the
previous implementation gave, bit for bit (tests/judging_reference.py is that implementation, kept verbatim; one
deliberate exception, `CHANGED`):
random tables with NaN and ±inf, missing steps, ragged windows, micro-batches that do not divide the batch, one
window step, windows per prompt group, float64 inputs, empty batches, advantages. And the primitives the views
rely on add in the order they promise, checked against a plain Python loop."""

from __future__ import annotations

import math
import struct

import judging_reference as reference
import numpy as np
import pytest

from rollout_consistency.gate.judging import views
from rollout_consistency.gate.judging.metrics import compute_metrics
from rollout_consistency.gate.judging.mismatch import STATISTICS, compute_mismatch, percentile

#: The one figure that changed on purpose: `pearson_logp`'s sums of products were BLAS dot products, whose
#: summation order depends on the CPU's kernel and OpenBLAS's thread count (and one thread wake-up per view cost
#: ~30 ms on a loaded machine); they are NumPy pairwise sums now, the same on every machine, a few ULP away.
CHANGED = {"pearson_logp": 1e-14}


def assert_same_bits(old, new, path="report"):
    """Equal structure, and every float equal bit for bit (NaN to NaN; 0.0 and -0.0 differ)."""
    name = path.rsplit(".", 1)[-1]
    if name in CHANGED and isinstance(old, float) and math.isfinite(old):
        assert new == pytest.approx(old, rel=CHANGED[name], abs=CHANGED[name]), f"{path}: {old!r} vs {new!r}"
        return
    if isinstance(old, float) or isinstance(new, float):
        assert isinstance(old, float) and isinstance(new, float), f"{path}: {old!r} vs {new!r}"
        assert struct.pack("<d", old) == struct.pack("<d", new) or (math.isnan(old) and math.isnan(new)), (
            f"{path}: {old!r} vs {new!r}"
        )
    elif isinstance(old, dict):
        for key in old:  # new keys may be added (the schema grows); none may change
            assert key in new, f"{path}: {key} missing"
            assert_same_bits(old[key], new[key], f"{path}.{key}")
    elif isinstance(old, (list, tuple)):
        assert len(old) == len(new), f"{path}: {len(old)} vs {len(new)} entries"
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            assert_same_bits(a, b, f"{path}[{i}]")
    else:
        assert old == new, f"{path}: {old!r} vs {new!r}"


def random_case(seed: int, rows: int | None = None, width: int | None = None):
    """Tables, metric settings and mismatch settings of one random case."""
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(0, 40)) if rows is None else rows
    width = int(rng.integers(1, 6)) if width is None else width
    rollout = rng.normal(-1.0, 0.3, (rows, width)).astype(np.float32)
    noise = rng.normal(0.0, 10.0 ** rng.uniform(-8, -1), (rows, width)) * (rng.random((rows, width)) < 0.8)
    trainer = (rollout + noise).astype(np.float32)
    if rows and rng.random() < 0.3:
        for _ in range(int(rng.integers(1, 3))):
            trainer[rng.integers(rows), rng.integers(width)] = rng.choice([np.nan, np.inf, -np.inf])
    if rows and rng.random() < 0.15:
        rollout[rng.integers(rows), rng.integers(width)] = rng.choice([np.nan, np.inf, -np.inf])
    metric_settings: dict = {}
    mismatch_settings: dict = {}
    if rng.random() < 0.7:
        metric_settings["micro_batch_size"] = int(rng.integers(1, 9))  # often not a divisor of rows
    if rng.random() < 0.5:
        metric_settings["clip_ratio"] = float(10.0 ** rng.uniform(-6, -2))
    if rng.random() < 0.2:
        metric_settings["clip_ratio_low"] = float(10.0 ** rng.uniform(-6, -2))
    if rng.random() < 0.25:  # ragged windows: a sample's row is padded after its last step
        lengths = rng.integers(0, width + 1, size=rows)
        metric_settings["trainer_mask"] = np.arange(width)[None, :] < lengths[:, None]
        metric_settings["rollout_mask"] = metric_settings["trainer_mask"].copy()
    if rng.random() < 0.2:  # a step missing on one side
        mask = rng.random((rows, width)) < 0.85
        metric_settings["trainer_mask"] = mask & metric_settings.get("trainer_mask", True)
    if rng.random() < 0.6:
        schedule = np.linspace(1000, 0, width + 10, dtype=np.float32)
        per_group = rng.random() < 0.5  # windows drawn per prompt group: exact values cross window positions
        starts = rng.integers(0, 10, size=rows) if per_group else np.full(rows, 3)
        steps = schedule[starts[:, None] + np.arange(width)[None, :]] if rows else np.zeros((0, width), np.float32)
        metric_settings["timesteps"] = mismatch_settings["timesteps"] = steps
    if rng.random() < 0.3:
        mismatch_settings["valid"] = np.isfinite(rollout) & np.isfinite(trainer)  # as the checker passes it
    elif rng.random() < 0.2:
        mismatch_settings["valid"] = rng.random((rows, width)) < 0.85
    if rng.random() < 0.3:
        mismatch_settings["advantages"] = rng.normal(size=rows)
    if rng.random() < 0.3:
        mismatch_settings["clip_ratio_low"], mismatch_settings["clip_ratio_high"] = 1e-3, 2e-3
    if rng.random() < 0.2:
        rollout, trainer = rollout.astype(np.float64), trainer.astype(np.float64)
    return rollout, trainer, metric_settings, mismatch_settings


def with_masks_paired(settings: dict) -> dict:
    """The reference's ``rollout_mask=, trainer_mask=`` as today's ``masks=(rollout_mask, trainer_mask)``."""
    settings = dict(settings)
    masks = (settings.pop("rollout_mask", None), settings.pop("trainer_mask", None))
    return settings if all(mask is None for mask in masks) else {**settings, "masks": masks}


@pytest.mark.parametrize("seed", range(120))
def test_small_random_tables_give_the_reference_bits(seed):
    rollout, trainer, metric_settings, mismatch_settings = random_case(seed)
    assert_same_bits(
        reference.compute_metrics(rollout, trainer, **metric_settings).to_dict(),
        compute_metrics(rollout, trainer, **with_masks_paired(metric_settings)).to_dict(),
    )
    assert_same_bits(
        reference.compute_mismatch(rollout, trainer, **mismatch_settings).to_dict(),
        compute_mismatch(rollout, trainer, **mismatch_settings).to_dict(),
    )


@pytest.mark.parametrize(
    "rows, width, micro, per_group",
    [(9000, 16, 1, False), (9001, 16, 7, True), (5000, 1, 3, False), (4500, 2, None, True), (6000, 16, 64, False)],
)
def test_large_tables_give_the_reference_bits(rows, width, micro, per_group):
    """Sizes that cross the views' blocks (8192 rows, 65536 cells) and the percentile's subsample path."""
    rng = np.random.default_rng(rows + width)
    rollout = rng.normal(-1.0, 0.3, (rows, width)).astype(np.float32)
    trainer = (rollout + rng.standard_t(3, (rows, width)) * 1e-5).astype(np.float32)
    schedule = np.linspace(1000, 0, width + 12, dtype=np.float32)
    starts = rng.integers(0, 12, size=rows) if per_group else np.zeros(rows, dtype=np.int64)
    steps = schedule[starts[:, None] + np.arange(width)[None, :]]
    settings = {"micro_batch_size": micro, "timesteps": steps, "clip_ratio": 1e-5}
    assert_same_bits(
        reference.compute_metrics(rollout, trainer, **settings).to_dict(),
        compute_metrics(rollout, trainer, **settings).to_dict(),
    )
    advantages = rng.normal(size=rows)
    assert_same_bits(
        reference.compute_mismatch(rollout, trainer, timesteps=steps, advantages=advantages).to_dict(),
        compute_mismatch(rollout, trainer, timesteps=steps, advantages=advantages).to_dict(),
    )


def test_new_statistics_are_added_not_changed():
    """The report's mismatch keys are the reference's plus the registered newcomers (JSON schema: added keys)."""
    rollout, trainer, _, settings = random_case(3, rows=12, width=3)
    old = reference.compute_mismatch(rollout, trainer, **settings).to_dict()["overall"]
    new = compute_mismatch(rollout, trainer, **settings).to_dict()["overall"]
    assert set(old) <= set(new) and set(new) - set(old) == {
        "kl",
        "chi2_token",
        "chi2_seq",
        "ppl_ratio",
        "log_ppl_diff",
        "log_ppl_abs_diff",
    }
    assert list(new)[1:] == list(STATISTICS)


# ----------------------------------------------------------------------------------------------------
def python_sum(values) -> float:
    total = 0.0
    for value in values:
        total = total + float(value)
    return total


def adversarial(rng, shape):
    """Values over 20 orders of magnitude with both signs: any other summation order changes the bits."""
    return rng.normal(size=shape) * 10.0 ** rng.uniform(-10, 10, size=shape)


@pytest.mark.parametrize("rows, width, micro", [(37, 1, 5), (64, 2, 8), (50, 16, 1), (41, 3, 41), (300, 16, 7)])
def test_cell_sums_add_rows_one_at_a_time(rows, width, micro):
    table = adversarial(np.random.default_rng(rows * width), (rows, width))
    got = views.cell_sums(table, micro, rows // micro)
    want = [[python_sum(table[start : start + micro, j]) for j in range(width)] for start in range(0, rows, micro)]
    assert got.tolist() == want


@pytest.mark.parametrize("rows, width", [(20000, 16), (33, 1), (9, 2)])
def test_row_sums_add_steps_in_order(rows, width):
    table = adversarial(np.random.default_rng(rows), (rows, width))
    assert views.row_sums(table).tolist() == [python_sum(row) for row in table]


@pytest.mark.parametrize("size", [0, 1, 65535, 65537, 200000])
def test_sequential_sum_adds_one_at_a_time(size):
    values = adversarial(np.random.default_rng(size), size)
    assert views.sequential_sum(values) == python_sum(values)


@pytest.mark.parametrize("rows, width", [(1000, 1), (1000, 2), (7, 16)])
def test_column_sums_add_rows_one_at_a_time(rows, width):
    table = adversarial(np.random.default_rng(rows + width), (rows, width))
    assert views.column_sums(table).tolist() == [python_sum(table[:, j]) for j in range(width)]


@pytest.mark.parametrize("rows, width, micro", [(4, 2, 2), (4, 1, 2), (5, 1, 2), (3, 1, 3)])
def test_zero_signs_follow_a_sum_from_zero(rows, width, micro):
    """A sum of -0.0 entries is +0.0, as a sum started at 0.0 gives (and as the reference reported it)."""
    table = np.full((rows, width), -0.0)
    assert all(math.copysign(1, v) == 1 for v in views.cell_sums(table, micro, rows // micro).ravel())
    assert all(math.copysign(1, v) == 1 for v in views.column_sums(table))


@pytest.mark.parametrize("seed", range(40))
def test_percentile_is_numpys_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.choice([1, 2, 3, 10, 101, 4097, 20000, 150000]))
    values = np.abs(rng.standard_t(2, size)) * 10.0 ** rng.uniform(-9, 0)
    if rng.random() < 0.3:
        values = np.round(values, 2)  # ties
    if rng.random() < 0.2:
        values[rng.integers(size)] = np.inf
    if rng.random() < 0.1:
        values[rng.integers(size)] = np.nan
    for q in (99, 50, 0, 100, 99.9):
        with np.errstate(invalid="ignore"):
            got, want = percentile(values, q), float(np.percentile(values, q))
        assert struct.pack("<d", got) == struct.pack("<d", want) or (math.isnan(got) and math.isnan(want)), (q, got)
    rows = np.abs(rng.normal(size=(3, 5000)))
    assert percentile(rows, 99).tolist() == [float(np.percentile(r, 99)) for r in rows]
