"""The judging figures as computed before the metric registry (main at db9a427), kept as the reference that the
vectorised code must reproduce bit for bit (tests/test_judging_bits.py) and the baseline scripts/bench_gate.py
times against. Not used by the package; do not edit (it is the old behaviour, by definition)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

METRIC_NAMES: tuple[str, ...] = (
    "ratio_mean",
    "ratio_std",
    "ppo_kl",
    "pg_clipfrac",
    "pg_clipfrac_higher",
    "pg_clipfrac_lower",
    "approx_kl",
    "mean_abs_dlogp",
    "max_abs_dlogp",
)

Side = Literal["rollout", "trainer"]


class MetricsInputError(ValueError):
    """The two log-prob tables cannot be compared (shape, dtype or mask mismatch)."""


@dataclass(frozen=True)
class MetricValues:
    """The nine figures of one view, plus the number of ``(sample, step)`` entries they summarise.

    A view with no entries has every figure NaN and ``count == 0``.
    """

    ratio_mean: float
    ratio_std: float
    ppo_kl: float
    pg_clipfrac: float
    pg_clipfrac_higher: float
    pg_clipfrac_lower: float
    approx_kl: float
    mean_abs_dlogp: float
    max_abs_dlogp: float
    count: int

    def get(self, metric: str) -> float:
        if metric not in METRIC_NAMES:
            raise KeyError(f"Unknown metric {metric!r}; expected one of {', '.join(METRIC_NAMES)}.")
        return getattr(self, metric)

    def is_finite(self) -> bool:
        return all(math.isfinite(getattr(self, name)) for name in METRIC_NAMES)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MetricValues:
        return cls(**{f.name: (int(data[f.name]) if f.name == "count" else float(data[f.name])) for f in fields(cls)})


@dataclass(frozen=True)
class StepMetrics:
    """Figures of one window position (``by_position``) or one exact timestep value (``by_timestep``).

    ``position`` is ``None`` in ``by_timestep`` entries when samples reach that timestep at different
    window positions; ``timestep`` is ``None`` in ``by_position`` entries when the position holds several
    timestep values (or no timesteps were given).
    """

    position: int | None
    timestep: float | None
    values: MetricValues

    def label(self) -> str:
        parts = []
        if self.position is not None:
            parts.append(f"step {self.position}")
        if self.timestep is not None:
            parts.append(f"t={self.timestep:.6g}")
        return " ".join(parts) if parts else "?"


@dataclass(frozen=True)
class SampleMetrics:
    """Figures of one sample over its own window steps."""

    index: int
    values: MetricValues


@dataclass(frozen=True)
class NonFiniteEntry:
    """A log-prob that is NaN or ±inf. ``value`` is ``"nan"``, ``"inf"`` or ``"-inf"``."""

    sample: int
    position: int
    side: Side
    value: str


@dataclass(frozen=True)
class MissingStep:
    """A window step that one side has and the other lacks."""

    sample: int
    position: int
    missing_on: Side


@dataclass(frozen=True)
class ConsistencyMetrics:
    """Everything [`compute_metrics`] measured. See the module docstring for the aggregation."""

    overall: MetricValues
    by_position: tuple[StepMetrics, ...]
    by_timestep: tuple[StepMetrics, ...]
    by_sample: tuple[SampleMetrics, ...]
    nonfinite: tuple[NonFiniteEntry, ...]
    missing: tuple[MissingStep, ...]
    empty_samples: tuple[int, ...]
    num_samples: int
    num_positions: int
    micro_batch_size: int | None
    clip_ratio_low: float
    clip_ratio_high: float

    def to_dict(self) -> dict[str, Any]:
        def step(s: StepMetrics) -> dict[str, Any]:
            return {"position": s.position, "timestep": s.timestep, "values": s.values.to_dict()}

        return {
            "overall": self.overall.to_dict(),
            "by_position": [step(s) for s in self.by_position],
            "by_timestep": [step(s) for s in self.by_timestep],
            "by_sample": [{"index": s.index, "values": s.values.to_dict()} for s in self.by_sample],
            "nonfinite": [vars(e).copy() for e in self.nonfinite],
            "missing": [vars(m).copy() for m in self.missing],
            "empty_samples": list(self.empty_samples),
            "num_samples": self.num_samples,
            "num_positions": self.num_positions,
            "micro_batch_size": self.micro_batch_size,
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ConsistencyMetrics:
        def step(d: dict[str, Any]) -> StepMetrics:
            ts = d["timestep"]
            return StepMetrics(d["position"], None if ts is None else float(ts), MetricValues.from_dict(d["values"]))

        return cls(
            overall=MetricValues.from_dict(data["overall"]),
            by_position=tuple(step(d) for d in data["by_position"]),
            by_timestep=tuple(step(d) for d in data["by_timestep"]),
            by_sample=tuple(SampleMetrics(d["index"], MetricValues.from_dict(d["values"])) for d in data["by_sample"]),
            nonfinite=tuple(NonFiniteEntry(**d) for d in data["nonfinite"]),
            missing=tuple(MissingStep(**d) for d in data["missing"]),
            empty_samples=tuple(data["empty_samples"]),
            num_samples=data["num_samples"],
            num_positions=data["num_positions"],
            micro_batch_size=data["micro_batch_size"],
            clip_ratio_low=float(data["clip_ratio_low"]),
            clip_ratio_high=float(data["clip_ratio_high"]),
        )


# ----------------------------------------------------------------------------------------------------
def compute_metrics(
    rollout_log_probs: Any,
    trainer_log_probs: Any,
    *,
    clip_ratio: float = 1e-4,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    micro_batch_size: int | None = None,
    rollout_mask: Any = None,
    trainer_mask: Any = None,
    timesteps: Any = None,
) -> ConsistencyMetrics:
    """Compare rollout and trainer log-probs of the same window steps.

    Args:
        rollout_log_probs (`torch.Tensor` or `np.ndarray` of shape `(B, W)`, float32):
            Log-prob of each window step as the rollout stored it (``old_log_prob``).
        trainer_log_probs (`torch.Tensor` or `np.ndarray` of shape `(B, W)`, float32):
            The trainer's recomputation of the same steps (``log_prob``).
        clip_ratio (`float`): PPO clip range ε (``clip_ratio`` / Flow-GRPO ``clip_range``).
        clip_ratio_low, clip_ratio_high (`float`, *optional*): asymmetric ranges (verl
            ``clip_ratio_low``/``clip_ratio_high``); each defaults to ``clip_ratio``.
        micro_batch_size (`int`, *optional*): the trainer's micro-batch size; ``None`` = one micro-batch.
        rollout_mask, trainer_mask (`(B, W)` bool, *optional*): which steps each side has (default: all).
            A sample with a shorter window pads its row and clears the mask there.
        timesteps (`(B, W)` float, *optional*): exact timestep value of each step, for ``by_timestep``.

    Raises:
        MetricsInputError: shapes differ, a table is not 2-D, or a dtype is not float32/float64 (a bf16
            log-prob has already lost the digits this comparison is about).
    """
    rollout = _as_float64(rollout_log_probs, "rollout_log_probs")
    trainer = _as_float64(trainer_log_probs, "trainer_log_probs")
    if rollout.shape != trainer.shape:
        raise MetricsInputError(
            f"rollout log-probs have shape {rollout.shape} but the trainer's have {trainer.shape}: both sides "
            f"must score the same (samples, window steps); check the SDE window and batch on each side."
        )
    shape = rollout.shape
    r_mask = _as_mask(rollout_mask, shape, "rollout_mask")
    t_mask = _as_mask(trainer_mask, shape, "trainer_mask")
    steps = None if timesteps is None else _as_float64(timesteps, "timesteps", expect=shape)
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    for name, value in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise MetricsInputError(f"{name} must be a finite number >= 0, got {value!r}.")
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or micro_batch_size < 1):
        raise MetricsInputError(f"micro_batch_size must be a positive int or None, got {micro_batch_size!r}.")

    batch, width = shape
    if micro_batch_size is not None:
        micro_batch_size = min(micro_batch_size, max(batch, 1))  # a micro-batch wider than the batch is the batch
    missing = tuple(
        MissingStep(int(b), int(w), side)
        for side, where in (("trainer", r_mask & ~t_mask), ("rollout", t_mask & ~r_mask))
        for b, w in zip(*np.nonzero(where), strict=False)
    )
    missing = tuple(sorted(missing, key=lambda m: (m.sample, m.position, m.missing_on)))
    valid = r_mask & t_mask
    nonfinite = tuple(
        sorted(
            (
                NonFiniteEntry(int(b), int(w), side, _name_nonfinite(table[b, w]))
                for side, table in (("rollout", rollout), ("trainer", trainer))
                for b, w in zip(*np.nonzero(valid & ~np.isfinite(table)), strict=False)
            ),
            key=lambda e: (e.sample, e.position, e.side),
        )
    )
    empty_samples = tuple(int(b) for b in np.nonzero(~valid.any(axis=1))[0])

    # One row per valid (sample, step) entry.
    sample_idx, position = np.nonzero(valid)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN on purpose: flagged above, propagated below
        delta = trainer[sample_idx, position] - rollout[sample_idx, position]
    entries = _entry_values(delta, low, high)
    mbs = batch if micro_batch_size is None else micro_batch_size
    micro = sample_idx // max(mbs, 1)

    _, overall_values = _aggregate_groups(entries, cell=(micro, position), group=np.zeros_like(position))
    overall = overall_values[0] if overall_values else _empty_values()

    by_position = []
    for pos, values in zip(*_aggregate_groups(entries, cell=(micro, position), group=position), strict=False):
        ts = None
        if steps is not None:
            seen = np.unique(steps[sample_idx[position == pos], pos])
            ts = float(seen[0]) if seen.size == 1 else None
        by_position.append(StepMetrics(int(pos), ts, values))

    by_timestep: list[StepMetrics] = []
    if steps is not None:
        step_values = steps[sample_idx, position]
        # Group by the exact float64 value (bit pattern of the float32 timestep) — no rounding merges.
        keys, inverse = np.unique(step_values, return_inverse=True)
        for key_index, values in zip(*_aggregate_groups(entries, cell=(micro, inverse), group=inverse), strict=False):
            positions = np.unique(position[inverse == key_index])
            pos = int(positions[0]) if positions.size == 1 else None
            by_timestep.append(StepMetrics(pos, float(keys[key_index]), values))
        # Denoising order: high noise (large t) first.
        by_timestep.sort(key=lambda s: -s.timestep)  # type: ignore[operator]

    per_sample = dict(zip(*_aggregate_groups(entries, cell=(sample_idx,), group=sample_idx), strict=False))
    by_sample = [SampleMetrics(b, per_sample.get(b, _empty_values())) for b in range(batch)]

    return ConsistencyMetrics(
        overall=overall,
        by_position=tuple(by_position),
        by_timestep=tuple(by_timestep),
        by_sample=tuple(by_sample),
        nonfinite=nonfinite,
        missing=missing,
        empty_samples=empty_samples,
        num_samples=batch,
        num_positions=width,
        micro_batch_size=micro_batch_size,
        clip_ratio_low=float(low),
        clip_ratio_high=float(high),
    )


# ----------------------------------------------------------------------------------------------------
_ALLOWED_DTYPES = ("float32", "float64")


def _to_numpy(value: Any) -> Any:
    """A torch tensor as a NumPy array (without importing torch here); anything else unchanged."""
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


def _as_float64(value: Any, name: str, expect: tuple[int, ...] | None = None) -> np.ndarray:
    if value is None:
        raise MetricsInputError(f"`{name}` is required.")
    try:
        value = _to_numpy(value)
    except TypeError as error:  # bf16 tensors refuse .numpy()
        raise MetricsInputError(
            f"`{name}` is {getattr(value, 'dtype', '?')}; log-probs must be stored and compared in float32. "
            f"Keep the scheduler's float32 log_prob instead of casting it."
        ) from error
    array = np.asarray(value)
    if array.dtype.name not in _ALLOWED_DTYPES:
        raise MetricsInputError(
            f"`{name}` has dtype {array.dtype}; expected float32 (or float64). Low-precision log-probs have "
            f"already lost the digits this check compares; keep the scheduler's float32 output."
        )
    if expect is not None and array.shape != expect:
        raise MetricsInputError(f"`{name}` has shape {array.shape}, expected {expect}.")
    if expect is None and array.ndim != 2:
        raise MetricsInputError(f"`{name}` must have shape (batch, window_steps); got {array.shape}.")
    return array.astype(np.float64)


def _as_mask(value: Any, shape: tuple[int, ...], name: str) -> np.ndarray:
    if value is None:
        return np.ones(shape, dtype=bool)
    array = np.asarray(_to_numpy(value))
    if array.shape != shape:
        raise MetricsInputError(f"`{name}` has shape {array.shape}, expected {shape} (one flag per step).")
    if array.dtype != bool and not np.isin(array, (0, 1)).all():
        raise MetricsInputError(f"`{name}` must hold booleans (or 0/1).")
    return array.astype(bool)


def _name_nonfinite(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _entry_values(delta: np.ndarray, low: float, high: float) -> dict[str, np.ndarray]:
    """Per-entry quantities, float64. Clip indicators are NaN where the ratio is NaN."""
    with np.errstate(over="ignore", invalid="ignore"):
        ratio = np.exp(delta)
        undefined = np.isnan(ratio)
        higher = np.where(undefined, np.nan, (ratio - 1.0 > high).astype(np.float64))
        lower = np.where(undefined, np.nan, (1.0 - ratio > low).astype(np.float64))
        clipped = np.where(undefined, np.nan, np.maximum(higher, lower))
        return {
            "ratio": ratio,
            "neg_delta": -delta,
            "higher": higher,
            "lower": lower,
            "clipped": clipped,
            "half_sq": 0.5 * delta * delta,
            "abs": np.abs(delta),
        }


_MEAN_OF = {
    "ratio_mean": "ratio",
    "ppo_kl": "neg_delta",
    "pg_clipfrac": "clipped",
    "pg_clipfrac_higher": "higher",
    "pg_clipfrac_lower": "lower",
    "approx_kl": "half_sq",
    "mean_abs_dlogp": "abs",
}


def _empty_values() -> MetricValues:
    return MetricValues(**{name: math.nan for name in METRIC_NAMES}, count=0)


def _dense_ids(*keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Dense ids 0..n-1 of the distinct tuples of non-negative int keys (one combined int64 key, then unique)."""
    if keys[0].size == 0:
        return np.zeros(0, dtype=np.int64), 0
    combined = np.zeros(keys[0].shape, dtype=np.int64)
    for key in keys:
        key = np.asarray(key, dtype=np.int64)
        combined = combined * (int(key.max()) + 1) + key
    _, inverse = np.unique(combined, return_inverse=True)
    inverse = inverse.reshape(-1)
    return inverse, int(inverse.max()) + 1


def _aggregate_groups(
    entries: dict[str, np.ndarray], *, cell: tuple[np.ndarray, ...], group: np.ndarray
) -> tuple[list[int], list[MetricValues]]:
    """Cell means (and in-cell std), then unweighted means over the cells of each group. Vectorised."""
    group = np.asarray(group, dtype=np.int64)
    if group.size == 0:
        return [], []
    group_id, n_groups = _dense_ids(group)
    cell_id, n_cells = _dense_ids(*cell, group)
    counts = np.bincount(cell_id, minlength=n_cells).astype(np.float64)
    cell_group = np.zeros(n_cells, dtype=np.int64)
    cell_group[cell_id] = group_id
    cells_per_group = np.bincount(cell_group, minlength=n_groups).astype(np.float64)
    figures: dict[str, np.ndarray] = {}
    with np.errstate(invalid="ignore", over="ignore"):
        cell_means = {}
        for metric, key in _MEAN_OF.items():
            cell_means[metric] = np.bincount(cell_id, weights=entries[key], minlength=n_cells) / counts
        deviation = entries["ratio"] - cell_means["ratio_mean"][cell_id]
        cell_means["ratio_std"] = np.sqrt(
            np.bincount(cell_id, weights=deviation * deviation, minlength=n_cells) / counts
        )
        for metric, values in cell_means.items():
            figures[metric] = np.bincount(cell_group, weights=values, minlength=n_groups) / cells_per_group
        # np.maximum propagates NaN: a NaN entry makes the max NaN, never hides behind a finite one.
        maxima = np.full(n_groups, -np.inf)
        np.maximum.at(maxima, group_id, entries["abs"])
        figures["max_abs_dlogp"] = maxima
    entry_counts = np.bincount(group_id, minlength=n_groups)
    first_of_group = np.zeros(n_groups, dtype=np.int64)
    first_of_group[group_id[::-1]] = group[::-1]  # the original group label of each dense id
    values = [
        MetricValues(**{name: float(figures[name][g]) for name in METRIC_NAMES}, count=int(entry_counts[g]))
        for g in range(n_groups)
    ]
    return [int(label) for label in first_of_group], values


# ---- mismatch.py as of db9a427


MISMATCH_NAMES: tuple[str, ...] = (
    "k3_kl",
    "chi2",
    "ess",
    "p99_abs_dlogp",
    "max_abs_dlogp",
    "pearson_logp",
    "bias",
    "bias_ci_low",
    "bias_ci_high",
)
ADVANTAGE_NAMES: tuple[str, ...] = ("pg_clipfrac_adv", "pg_clipfrac_dual")
#: Two-sided 95 % normal quantile.
_Z95 = 1.959963984540054


@dataclass(frozen=True)
class MismatchValues:
    """The statistics of one view. ``pg_clipfrac_adv`` / ``pg_clipfrac_dual`` are ``None`` without advantages."""

    count: int
    k3_kl: float
    chi2: float
    ess: float
    p99_abs_dlogp: float
    max_abs_dlogp: float
    pearson_logp: float
    bias: float
    bias_ci_low: float
    bias_ci_high: float
    pg_clipfrac_adv: float | None = None
    pg_clipfrac_dual: float | None = None

    def names(self) -> tuple[str, ...]:
        return MISMATCH_NAMES + (ADVANTAGE_NAMES if self.pg_clipfrac_adv is not None else ())

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MismatchValues:
        def num(value: Any) -> float | None:
            return None if value is None else float(value)

        return cls(count=int(data["count"]), **{n: num(data.get(n)) for n in MISMATCH_NAMES + ADVANTAGE_NAMES})


@dataclass(frozen=True)
class StepMismatch:
    """Statistics at one timestep value (or window position when no timesteps were given)."""

    position: int | None
    timestep: float | None
    values: MismatchValues

    def to_dict(self) -> dict[str, Any]:
        return {"position": self.position, "timestep": self.timestep, "values": self.values.to_dict()}


@dataclass(frozen=True)
class MismatchStats:
    """Everything [`compute_mismatch`] measured: ``overall`` and one entry per timestep (or position)."""

    overall: MismatchValues
    by_timestep: tuple[StepMismatch, ...]
    clip_ratio_low: float
    clip_ratio_high: float
    clip_ratio_c: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "overall": self.overall.to_dict(),
            "by_timestep": [s.to_dict() for s in self.by_timestep],
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
            "clip_ratio_c": self.clip_ratio_c,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MismatchStats:
        def step(d: dict[str, Any]) -> StepMismatch:
            ts = d["timestep"]
            return StepMismatch(d["position"], None if ts is None else float(ts), MismatchValues.from_dict(d["values"]))

        return cls(
            overall=MismatchValues.from_dict(data["overall"]),
            by_timestep=tuple(step(d) for d in data["by_timestep"]),
            clip_ratio_low=float(data["clip_ratio_low"]),
            clip_ratio_high=float(data["clip_ratio_high"]),
            clip_ratio_c=float(data["clip_ratio_c"]),
        )


def compute_mismatch(
    rollout_log_probs: np.ndarray,
    trainer_log_probs: np.ndarray,
    *,
    valid: np.ndarray | None = None,
    timesteps: np.ndarray | None = None,
    advantages: np.ndarray | None = None,
    clip_ratio_low: float = 1e-4,
    clip_ratio_high: float = 1e-4,
    clip_ratio_c: float = 3.0,
) -> MismatchStats:
    """Mismatch statistics of two log-prob tables (see the module docstring for each definition).

    Args:
        rollout_log_probs, trainer_log_probs (`np.ndarray` of shape `(N, T)`, float32/float64): the two sides;
            widened to float64 here.
        valid (`(N, T)` bool, *optional*): entries to use (default: all).
        timesteps (`(N, T)` float, *optional*): exact timestep of each entry; without it, views are by position.
        advantages (`(N,)` float, *optional*): one advantage per sample, for the advantage-dependent clip
            fractions.
        clip_ratio_low, clip_ratio_high (`float`): PPO clip ranges ε_low, ε_high.
        clip_ratio_c (`float`): verl's dual-clip constant (> 1).
    """
    rollout = np.asarray(rollout_log_probs, dtype=np.float64)
    trainer = np.asarray(trainer_log_probs, dtype=np.float64)
    mask = np.ones(rollout.shape, dtype=bool) if valid is None else np.asarray(valid, dtype=bool)
    sample, position = np.nonzero(mask)
    adv = None if advantages is None else np.asarray(advantages, dtype=np.float64)[sample]
    entries = (sample, rollout[sample, position], trainer[sample, position], adv)
    settings = (clip_ratio_low, clip_ratio_high, clip_ratio_c)
    overall = _values(*entries, *settings)
    steps: list[StepMismatch] = []
    if timesteps is not None:
        values = np.asarray(timesteps, dtype=np.float64)[sample, position]
        for key in sorted(np.unique(values), reverse=True):  # denoising order: large t first
            pick = values == key
            at = np.unique(position[pick])
            pos = int(at[0]) if at.size == 1 else None
            steps.append(StepMismatch(pos, float(key), _values(*(_take(e, pick) for e in entries), *settings)))
    else:
        for pos in np.unique(position):
            pick = position == pos
            steps.append(StepMismatch(int(pos), None, _values(*(_take(e, pick) for e in entries), *settings)))
    return MismatchStats(overall, tuple(steps), float(clip_ratio_low), float(clip_ratio_high), float(clip_ratio_c))


def _take(array: np.ndarray | None, pick: np.ndarray) -> np.ndarray | None:
    return None if array is None else array[pick]


def _values(
    sample: np.ndarray,
    rollout: np.ndarray,
    trainer: np.ndarray,
    adv: np.ndarray | None,
    low: float,
    high: float,
    dual: float,
) -> MismatchValues:
    n = int(rollout.size)
    if n == 0:
        nan = math.nan
        extra = {} if adv is None else {"pg_clipfrac_adv": nan, "pg_clipfrac_dual": nan}
        return MismatchValues(0, nan, nan, nan, nan, nan, nan, nan, nan, nan, **extra)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        delta = trainer - rollout
        w = np.exp(delta)
        w_minus_1 = np.expm1(delta)  # exact for tiny Δ, where exp(Δ) − 1 would cancel
        abs_delta = np.abs(delta)
        mean_w = float(np.mean(w))
        mean_w2 = float(np.mean(w * w))
        ess = mean_w * mean_w / mean_w2 if mean_w2 > 0 else math.nan
        # Per-sample means of Δ: the independent units of the bias and its interval.
        ids, inverse = np.unique(sample, return_inverse=True)
        per_sample = np.bincount(inverse, weights=delta) / np.bincount(inverse)
        bias = float(np.mean(per_sample))
        if ids.size >= 2:
            half = _Z95 * float(np.std(per_sample, ddof=1)) / math.sqrt(ids.size)
            ci = (bias - half, bias + half)
        else:
            ci = (math.nan, math.nan)
        extra: dict[str, float] = {}
        if adv is not None:
            clipped = np.clip(w, 1.0 - low, 1.0 + high)
            active = ((adv > 0) & (w > 1.0 + high)) | ((adv < 0) & (w < 1.0 - low))
            dual_active = (adv < 0) & (np.maximum(w, clipped) > dual)
            undefined = np.isnan(w)
            extra["pg_clipfrac_adv"] = float(np.mean(np.where(undefined, np.nan, active)))
            extra["pg_clipfrac_dual"] = float(np.mean(np.where(undefined, np.nan, dual_active)))
        return MismatchValues(
            count=n,
            k3_kl=float(np.mean(w_minus_1 - delta)),
            chi2=float(np.mean(w_minus_1 * w_minus_1)),
            ess=float(ess),
            p99_abs_dlogp=float(np.percentile(abs_delta, 99)),
            max_abs_dlogp=float(np.max(abs_delta)),
            pearson_logp=_pearson(rollout, trainer),
            bias=bias,
            bias_ci_low=float(ci[0]),
            bias_ci_high=float(ci[1]),
            **extra,
        )


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    if x.size < 2 or not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return math.nan  # undefined with < 2 entries; non-finite entries propagate as NaN
    dx, dy = x - x.mean(), y - y.mean()
    denominator = math.sqrt(float(np.dot(dx, dx)) * float(np.dot(dy, dy)))
    return float(np.dot(dx, dy)) / denominator if denominator > 0 else math.nan
