# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Mismatch statistics beyond ``ratio_mean`` and ``ppo_kl``: the figures LLM trainers log for the
rollout/trainer gap, overall and per timestep. Reported, not gated.

Each statistic is one `Statistic` entry of the `STATISTICS` registry (name, definition, whose definition it
follows, a function of a `StatisticView`); `statistics_table` renders them for docs/checker.md, which holds the
definitions. With ``Δ = logp_trainer − logp_rollout`` and ``w = exp(Δ)`` (the importance weight
π_trainer/π_rollout of a sample drawn by the rollout), every figure is pooled over the ``(sample, step)`` entries
of its view — not a mean of per-micro-batch cells as the gated trainer figures are. The sample is the unit of
the per-sample figures (the bias and its interval, verl's per-sequence ``chi2_seq`` and perplexity ratios): a
sample's steps share its latents, and its window is its sequence.

Every statistic reduces along the last axis, so the overall view (one row of all entries) and, when each
timestep is one whole window position, all per-timestep views (one row per timestep) are computed at once;
other views are picked entry by entry. Sums are NumPy's pairwise sums over the view's entries in (sample, step)
order, the order the report's figures have always had.

Non-finite log-probs propagate: a NaN entry makes every figure of its view NaN (the verdict's ``finite``
guard names it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from rollout_consistency.base.registry import Registry, markdown_table

from .views import key_table, row_sums

#: Two-sided 95 % normal quantile.
_Z95 = 1.959963984540054
#: verl's ``SAFETY_BOUND``: log-ratios (and their per-sequence sums) are clamped to ±20 before ``exp`` in χ².
SAFETY_BOUND = 20.0
#: Entries per block of the Pearson sums (three float64 scratch tables of this size stay in cache).
_PEARSON_BLOCK = 1 << 16
#: Samples per block when the per-timestep views' table is written column by column (a block stays in cache).
_TRANSPOSE_ROWS = 2048


class StatisticView:
    """The entries of one view — or of several views at once, one per row of ``(views, n)`` arrays — that a
    statistic reads. Every reduction a statistic makes runs along the last axis (``axis=-1``), so one function
    serves the overall view and all per-timestep views.

    Attributes:
        delta: ``Δ = logp_trainer − logp_rollout`` of the view's entries, in (sample, step) order (float64).
        rollout, trainer: the two sides' entries as stored (float32 or float64; views of the tables where possible).
        per_sample_sum, per_sample_mean: ``Σ Δ`` and mean ``Δ`` over each sample's entries in the view (the samples
            that have one), in sample order: the sample is the independent unit.
        advantages: each entry's sample advantage (None without advantages).
        clip_ratio_low, clip_ratio_high, clip_ratio_c: the clip ranges and verl's dual-clip constant.

    Tables derived from ``delta`` (`w`, `w_minus_1`, `abs_delta`) are kept one at a time, so a view holds at most
    two tables of its size; a statistic should make at most one more.
    """

    def __init__(
        self,
        delta: np.ndarray,
        *,
        sides: Callable[[], tuple[np.ndarray, np.ndarray]],
        per_sample: Callable[[], tuple[np.ndarray, np.ndarray | None]],
        advantages: Callable[[], np.ndarray] | None,
        clips: tuple[float, float, float],
    ) -> None:
        self.delta = delta
        self._sides = sides
        self._per_sample = per_sample
        self._samples: tuple[np.ndarray, np.ndarray] | None = None
        self._advantages = advantages
        self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c = clips
        self._cached: tuple[str, np.ndarray] | None = None
        self.memo: dict[str, Any] = {}  # small results one statistic computes for another

    def _cache(self, key: str, make: Callable[[], np.ndarray]) -> np.ndarray:
        if self._cached is None or self._cached[0] != key:
            self._cached = None
            self._cached = (key, make())
        return self._cached[1]

    def _sample_figures(self) -> tuple[np.ndarray, np.ndarray]:
        if self._samples is None:
            sums, counts = self._per_sample()  # counts None: one entry per sample, the mean is the sum
            self._samples = (sums, sums if counts is None else sums / counts)
        return self._samples

    @property
    def per_sample_sum(self) -> np.ndarray:
        return self._sample_figures()[0]

    @property
    def per_sample_mean(self) -> np.ndarray:
        return self._sample_figures()[1]

    @property
    def w(self) -> np.ndarray:
        """The importance weight ``exp(Δ)``."""
        return self._cache("w", lambda: np.exp(self.delta))

    @property
    def w_minus_1(self) -> np.ndarray:
        """``exp(Δ) − 1`` without cancellation (``expm1``)."""
        return self._cache("w_minus_1", lambda: np.expm1(self.delta))

    @property
    def abs_delta(self) -> np.ndarray:
        return self._cache("abs_delta", lambda: np.abs(self.delta))

    @property
    def advantages(self) -> np.ndarray | None:
        return None if self._advantages is None else self._advantages()

    def mean_of(self, make: Callable[[np.ndarray], np.ndarray], source: np.ndarray) -> Any:
        """``mean(make(source), axis=-1)``, computed once per function and source table: in the per-timestep views each
        sample has one entry there, so its per-sample sums are the entries (`chi2_seq` is `chi2_token` then)."""
        for seen_make, seen_source, value in self.memo.setdefault("mean_of", []):
            if seen_make is make and seen_source is source:
                return value
        value = _mean(make(source))
        self.memo["mean_of"].append((make, source, value))
        return value

    def sides(self) -> tuple[np.ndarray, np.ndarray]:
        """The two log-prob tables' entries as stored, ``(rollout, trainer)``."""
        self._cached = None  # room for the caller's float64 blocks
        return self._sides()


@dataclass(frozen=True)
class Statistic:
    """One mismatch statistic: reported in every view, never gated.

    Attributes:
        name: its key in JSON (``mismatch.overall.<name>``) and JUnit (``mismatch.<view>.<name>``).
        definition: one line for the docs table (docs/checker.md is held to it by a test).
        value: the statistic of a [`StatisticView`], reducing along the last axis (one value per view row).
        follows: whose definition it is (another trainer's name for it, or "—").
        column: the terminal table's column header; None keeps it out of the table (JSON and JUnit only).
        needs_advantages: only computed when advantages are given (None in the report otherwise).
    """

    name: str
    definition: str
    value: Callable[[StatisticView], Any]
    follows: str = "—"
    column: str | None = None
    needs_advantages: bool = False

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name == "count":
            raise ValueError(f"statistic name {self.name!r} must be an identifier other than 'count'.")


#: The mismatch statistics, in report order. A new statistic is one `Statistic` and one `STATISTICS.register`
#: call: every report computes it overall and per timestep, and carries it in JSON and JUnit (and the table
#: when it has a `column`).
STATISTICS: Registry[Statistic] = Registry("statistic")


def _mean(x: np.ndarray) -> Any:
    return np.mean(x, axis=-1)


def _ess(view: StatisticView) -> Any:
    mean_w = _mean(view.w)
    mean_w2 = _mean(view.w * view.w)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean_w2 > 0, mean_w * mean_w / mean_w2, np.nan)


def _bias(view: StatisticView) -> tuple[Any, Any]:
    """The mean over samples of each sample's mean Δ, and its 95 % half-width ``1.96·s/√n`` (NaN below 2 samples)."""
    if "bias" not in view.memo:
        means = view.per_sample_mean
        samples = means.shape[-1]
        if samples < 2:
            half = np.full(means.shape[:-1], np.nan)
        else:
            half = _Z95 * np.std(means, axis=-1, ddof=1) / math.sqrt(samples)
        view.memo["bias"] = (_mean(means), half)
    return view.memo["bias"]


def _pearson(view: StatisticView) -> Any:
    """Σ dx·dy / sqrt(Σ dx² · Σ dy²) about the means. Every sum adds NumPy pairwise sums of blocks, one block at a
    time: the same number on every machine (not BLAS, whose order depends on the CPU's kernel and its threads),
    and no float64 copy of either table: each block is widened into three cache-sized scratch tables."""
    x, y = view.sides()
    if x.shape[-1] < 2:
        return np.full(x.shape[:-1], np.nan)  # undefined with < 2 entries
    n = x.shape[-1]
    shape = x.shape[:-1]
    step = max(256, _PEARSON_BLOCK // max(1, int(np.prod(shape))))
    blocks = [slice(start, min(n, start + step)) for start in range(0, n, step)]
    mean_x, mean_y = np.zeros(shape), np.zeros(shape)
    for block in blocks:
        mean_x += np.sum(x[..., block], axis=-1, dtype=np.float64)
        mean_y += np.sum(y[..., block], axis=-1, dtype=np.float64)
    mean_x, mean_y = mean_x / n, mean_y / n
    # A non-finite entry makes its side's sum, so its mean, non-finite: the correlation is NaN then.
    finite = np.isfinite(mean_x) & np.isfinite(mean_y)
    sxy, sxx, syy = np.zeros(shape), np.zeros(shape), np.zeros(shape)
    scratch = np.empty((3, *shape, min(n, step)))
    for block in blocks:
        dx, dy, product = scratch[..., : block.stop - block.start]  # each row contiguous: pairwise sums
        np.subtract(x[..., block], mean_x[..., None], out=dx, dtype=np.float64)
        np.subtract(y[..., block], mean_y[..., None], out=dy, dtype=np.float64)
        sxy += np.sum(np.multiply(dx, dy, out=product), axis=-1)
        sxx += np.sum(np.multiply(dx, dx, out=dx), axis=-1)
        syy += np.sum(np.multiply(dy, dy, out=dy), axis=-1)
    denominator = np.sqrt(sxx * syy)
    correlation = np.where(denominator > 0, sxy / np.where(denominator > 0, denominator, 1.0), np.nan)
    correlation = np.clip(correlation, -1.0, 1.0)  # two identical sides can round to 1 + 1 ulp
    return np.where(finite, correlation, np.nan)  # non-finite entries propagate as NaN


def _expm1_twice_clamped(log_ratio: np.ndarray) -> np.ndarray:
    """``expm1(2·clamp(log_ratio, ±20))`` = ``ρ² − 1`` with verl's clamp, in one scratch table."""
    out = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    out *= 2.0
    return np.expm1(out, out=out)


def _exp_of_negative(values: np.ndarray) -> np.ndarray:
    out = np.negative(values)
    return np.exp(out, out=out)


def _clip_fractions(view: StatisticView) -> tuple[Any, Any]:
    if "clip_fractions" not in view.memo:
        w, adv = view.w, view.advantages
        assert adv is not None
        low, high = view.clip_ratio_low, view.clip_ratio_high
        undefined = np.isnan(w)
        active = ((adv > 0) & (w > 1.0 + high)) | ((adv < 0) & (w < 1.0 - low))
        # max(w, clip(w, 1 − ε_low, 1 + ε_high)) is max(w, 1 − ε_low), value for value
        dual_active = (adv < 0) & (np.maximum(w, 1.0 - low) > view.clip_ratio_c)
        del adv
        fractions = []
        for flags in (active, dual_active):
            share = flags.astype(np.float64)
            share[undefined] = np.nan
            fractions.append(_mean(share))
        view.memo["clip_fractions"] = tuple(fractions)
    return view.memo["clip_fractions"]


for _statistic in (
    Statistic(
        "k3_kl",
        "`mean(w − 1 − Δlogp)`, KL(π_rollout ‖ π_trainer), ≥ 0 per entry",
        lambda v: _mean(v.w_minus_1 - v.delta),
        follows="Schulman's k3; verl rollout correction's `k3_kl` (evaluated with `expm1`, without cancellation)",
        column="k3_kl",
    ),
    Statistic(
        "chi2",
        "`mean((w − 1)²)`: χ² of the weights about 1",
        lambda v: _mean(v.w_minus_1 * v.w_minus_1),
        follows="not verl's: verl's χ² figures are `chi2_token` and `chi2_seq`",
        column="chi2",
    ),
    Statistic(
        "ess",
        "`mean(w)² / mean(w²)` = `1/mean(w̃²)`, `w̃ = w/mean(w)`: ESS as a fraction of the entries, 1 = agreement",
        _ess,
        follows="verl `rollout_is_eff_sample_size` (self-normalised), without its truncation",
        column="ess",
    ),
    Statistic(
        "p99_abs_dlogp",
        "99th percentile (linear interpolation) of `|Δlogp|`",
        lambda v: percentile(v.abs_delta, 99),
        column="p99|dlogp|",
    ),
    Statistic("max_abs_dlogp", "max of `|Δlogp|`", lambda v: np.max(v.abs_delta, axis=-1), column="max|dlogp|"),
    Statistic(
        "pearson_logp",
        "Pearson correlation of the two log-prob tables (NaN if a side is constant)",
        _pearson,
        follows="verl's `rollout_actor_probs_pearson_corr` correlates token probabilities; here log-probs",
        column="pearson",
    ),
    Statistic(
        "bias",
        "mean over samples of each sample's mean `Δlogp`",
        lambda v: _bias(v)[0],
        column="bias",
    ),
    Statistic(
        "bias_ci_low",
        "`bias − 1.96·s/√n` over the `n` per-sample means (normal approximation; NaN below 2 samples)",
        lambda v: _bias(v)[0] - _bias(v)[1],
    ),
    Statistic("bias_ci_high", "`bias + 1.96·s/√n`", lambda v: _bias(v)[0] + _bias(v)[1]),
    Statistic(
        "kl",
        "`mean(logp_rollout − logp_trainer)` over the entries",
        lambda v: -_mean(v.delta) + 0.0,
        follows="verl rollout correction `kl`",
    ),
    Statistic(
        "chi2_token",
        "`mean(ρ²) − 1`, `ρ = exp(clamp(Δlogp, ±20))`",
        lambda v: v.mean_of(_expm1_twice_clamped, v.delta),
        follows="verl rollout correction `chi2_token` (evaluated as `mean(expm1(2·clamp(Δlogp)))`)",
    ),
    Statistic(
        "chi2_seq",
        "mean over samples of `exp(2·clamp(Σ_t Δlogp, ±20)) − 1` (a sample's steps are its sequence)",
        lambda v: v.mean_of(_expm1_twice_clamped, v.per_sample_sum),
        follows="verl rollout correction `chi2_seq` (evaluated with `expm1`)",
    ),
    Statistic(
        "ppl_ratio",
        "mean over samples of `exp(mean_t logp_rollout − mean_t logp_trainer)`",
        lambda v: _mean(_exp_of_negative(v.per_sample_mean)),
        follows="verl rollout correction `ppl_ratio`",
    ),
    Statistic(
        "log_ppl_diff",
        "mean over samples of `mean_t logp_rollout − mean_t logp_trainer` (= −bias)",
        lambda v: -_bias(v)[0] + 0.0,
        follows="verl rollout correction `log_ppl_diff`",
    ),
    Statistic(
        "log_ppl_abs_diff",
        "mean over samples of `|mean_t logp_rollout − mean_t logp_trainer|`",
        lambda v: _mean(np.abs(v.per_sample_mean)),
        follows="verl rollout correction `log_ppl_abs_diff`",
    ),
    Statistic(
        "pg_clipfrac_adv",
        "`(A > 0 and w > 1 + ε_high) or (A < 0 and w < 1 − ε_low)`",
        lambda v: _clip_fractions(v)[0],
        follows="LLM verl `actor/pg_clipfrac`",
        column="clip_adv",
        needs_advantages=True,
    ),
    Statistic(
        "pg_clipfrac_dual",
        "`A < 0 and max(w, clip(w)) > clip_ratio_c` (3)",
        lambda v: _clip_fractions(v)[1],
        follows="LLM verl `actor/pg_clipfrac_lower`",
        column="clip_dual",
        needs_advantages=True,
    ),
):
    STATISTICS.register(_statistic)


def statistics_table() -> str:
    """The docs' table of the registered statistics (docs/checker.md holds exactly this; a test checks it)."""
    rows = [(f"`{s.name}`", s.definition, s.follows) for s in STATISTICS.values()]
    return markdown_table(("name", "definition", "follows"), rows)


#: The built-in statistics computed without advantages, and the two that need them (`STATISTICS` lists all).
MISMATCH_NAMES: tuple[str, ...] = tuple(s.name for s in STATISTICS.values() if not s.needs_advantages)
ADVANTAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STATISTICS.values() if s.needs_advantages)


# ----------------------------------------------------------------------------------------------------
class MismatchValues:
    """The statistics of one view by name (``values.k3_kl``), plus ``count``. A statistic that needs advantages is
    None without them."""

    __slots__ = ("_values", "count")
    _values: dict[str, float | None]
    count: int

    def __init__(self, values: Mapping[str, float | None] | None = None, /, *, count: int = 0, **named: float | None):
        object.__setattr__(self, "_values", {**(values or {}), **named})
        object.__setattr__(self, "count", int(count))

    def __getattr__(self, name: str) -> float | None:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name in STATISTICS and not name.startswith("_"):
            return None if STATISTICS[name].needs_advantages else math.nan
        raise AttributeError(f"MismatchValues has no statistic {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("MismatchValues is frozen")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MismatchValues):
            return NotImplemented
        return self.count == other.count and self._values == other._values

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_mismatch, (self._values, self.count))

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return f"MismatchValues(count={self.count}, {shown})"

    def get(self, name: str) -> float | None:
        return getattr(self, name)

    def names(self) -> tuple[str, ...]:
        """The statistics this view carries (those needing advantages only when they were given)."""
        return tuple(name for name, value in self._values.items() if value is not None)

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, **self._values}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MismatchValues:
        values = {k: (None if v is None else float(v)) for k, v in data.items() if k != "count"}
        for name in ADVANTAGE_NAMES:  # absent in old reports without advantages
            values.setdefault(name, None)
        return cls(values, count=int(data["count"]))


def _restore_mismatch(values: dict[str, float | None], count: int) -> MismatchValues:
    return MismatchValues(values, count=count)


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


# ----------------------------------------------------------------------------------------------------
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
    """Mismatch statistics of two log-prob tables: every registered statistic, overall and per timestep.

    Args:
        rollout_log_probs, trainer_log_probs (`np.ndarray` of shape `(N, T)`, float32/float64): the two sides;
            their difference is taken in float64.
        valid (`(N, T)` bool, *optional*): entries to use (default: all).
        timesteps (`(N, T)` float, *optional*): exact timestep of each entry; without it, views are by position.
        advantages (`(N,)` float, *optional*): one advantage per sample, for the advantage-dependent clip
            fractions.
        clip_ratio_low, clip_ratio_high (`float`): PPO clip ranges ε_low, ε_high.
        clip_ratio_c (`float`): verl's dual-clip constant (> 1).
    """
    rollout = np.asarray(rollout_log_probs)
    trainer = np.asarray(trainer_log_probs)
    mask = None if valid is None else np.asarray(valid, dtype=bool)
    if mask is not None and mask.all():
        mask = None
    adv = None if advantages is None else np.asarray(advantages, dtype=np.float64)
    clips = (clip_ratio_low, clip_ratio_high, clip_ratio_c)
    statistics = [s for s in STATISTICS.values() if adv is not None or not s.needs_advantages]
    optional = [s.name for s in STATISTICS.values() if adv is None and s.needs_advantages]

    tables = _Tables(rollout, trainer, mask, None if timesteps is None else np.asarray(timesteps), adv, clips)
    overall = _values(statistics, optional, _overall_view(tables))
    width = rollout.shape[1] if rollout.ndim == 2 else 0
    steps: list[StepMismatch] = []
    columns = _column_views(tables) if overall.count else None
    if columns is not None:  # every view is one whole column: all views at once
        order, labels, view = columns
        rows = _values(statistics, optional, view, rows=len(order))
        steps = [StepMismatch(pos, ts, rows[i]) for i, pos, ts in zip(order, *labels, strict=True)]
    elif overall.count:  # one view at a time
        steps = [
            StepMismatch(pos, ts, _values(statistics, optional, view)) for pos, ts, view in _picked_views(tables, width)
        ]
    return MismatchStats(overall, tuple(steps), float(clip_ratio_low), float(clip_ratio_high), float(clip_ratio_c))


def _values(
    statistics: Sequence[Statistic], optional: Sequence[str], view: StatisticView | None, rows: int | None = None
) -> Any:
    """The statistics of `view` (a list of `rows` MismatchValues when the view holds several views)."""
    if view is None:  # no entry
        return MismatchValues({**{s.name: math.nan for s in statistics}, **dict.fromkeys(optional)}, count=0)
    count = view.delta.shape[-1]
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        computed = {s.name: np.asarray(s.value(view), dtype=np.float64) for s in statistics}
    if rows is None:
        return MismatchValues({**{k: float(v) for k, v in computed.items()}, **dict.fromkeys(optional)}, count=count)
    return [
        MismatchValues({**{k: float(v[i]) for k, v in computed.items()}, **dict.fromkeys(optional)}, count=count)
        for i in range(rows)
    ]


@dataclass(frozen=True)
class _Tables:
    """What one `compute_mismatch` call compares, as its view builders read it (arrays; ``mask`` None when every
    entry is used)."""

    rollout: np.ndarray
    trainer: np.ndarray
    mask: np.ndarray | None
    timesteps: np.ndarray | None
    adv: np.ndarray | None
    clips: tuple[float, float, float]


def _overall_view(tables: _Tables) -> StatisticView | None:
    rollout, trainer, mask, adv, clips = tables.rollout, tables.trainer, tables.mask, tables.adv, tables.clips
    with np.errstate(invalid="ignore"):
        delta = np.subtract(trainer, rollout, dtype=np.float64)
    if mask is None:
        if delta.size == 0:
            return None
        width = delta.shape[1]
        return StatisticView(
            delta.reshape(-1),
            sides=lambda: (rollout.reshape(-1), trainer.reshape(-1)),
            per_sample=lambda: (row_sums(delta), np.full(delta.shape[0], width)),
            advantages=None if adv is None else lambda: np.repeat(adv, width),
            clips=clips,
        )
    if not mask.any():
        return None
    entries = delta[mask]
    delta[~mask] = 0.0  # adds nothing to a sample's sum
    present = mask.any(axis=1)
    return StatisticView(
        entries,
        sides=lambda: (rollout[mask], trainer[mask]),
        per_sample=lambda: (row_sums(delta)[present], mask.sum(axis=1)[present]),
        advantages=None if adv is None else lambda: np.broadcast_to(adv[:, None], mask.shape)[mask],
        clips=clips,
    )


def _column_views(tables: _Tables) -> tuple[list[int], tuple[list[int], list[float | None]], StatisticView] | None:
    """All views at once, one row each, when every entry is used and each view is one whole column (no
    timesteps, or one timestep value per column and a different one in each): None otherwise."""
    rollout, trainer, steps, adv = tables.rollout, tables.trainer, tables.timesteps, tables.adv
    if tables.mask is not None or rollout.ndim != 2 or rollout.shape[0] == 0:
        return None
    batch, width = rollout.shape
    positions = list(range(width))
    if steps is None:
        order, labels = positions, (positions, [None] * width)
    else:
        first = steps[0]
        if not (steps == first[None, :]).all() or np.unique(first).size != width:
            return None
        order = [int(j) for j in np.argsort(-first, kind="stable")]  # denoising order: large t first
        labels = (order, [float(first[j]) for j in order])
    delta = np.empty((width, batch))
    scratch = np.empty((min(batch, _TRANSPOSE_ROWS), width))
    with np.errstate(invalid="ignore"):
        for start in range(0, batch, _TRANSPOSE_ROWS):  # a block of rows in cache, written out transposed
            rows = slice(start, start + _TRANSPOSE_ROWS)
            block = scratch[: min(batch, rows.stop) - start]
            np.subtract(trainer[rows], rollout[rows], out=block, dtype=np.float64)
            delta[:, rows] = block.T[order]

    def per_sample() -> tuple[np.ndarray, None]:
        # One entry per sample in a column: its sum from 0.0 is the entry itself, but for -0.0 (which becomes 0.0).
        zeros = delta[delta == 0]
        return (delta + 0.0 if np.signbit(zeros).any() else delta), None

    def sides() -> tuple[np.ndarray, np.ndarray]:
        if order == positions:
            return rollout.T, trainer.T
        return rollout[:, order].T, trainer[:, order].T

    return (
        list(range(len(order))),
        labels,
        StatisticView(
            delta,
            sides=sides,
            per_sample=per_sample,
            advantages=None if adv is None else lambda: np.broadcast_to(adv[None, :], delta.shape),
            clips=tables.clips,
        ),
    )


def _picked_views(tables: _Tables, width: int) -> Iterator[tuple[int | None, float | None, StatisticView]]:
    """Each view's entries picked out of the tables, in (sample, step) order, one view at a time (views that are
    not whole columns: windows drawn per prompt group, or entries left out)."""
    rollout, trainer, mask, timesteps, adv = tables.rollout, tables.trainer, tables.mask, tables.timesteps, tables.adv
    flat_rollout, flat_trainer = rollout.reshape(-1), trainer.reshape(-1)
    groups: list[tuple[int | None, float | None, np.ndarray]] = []  # (position, timestep, flat entry indices)
    if timesteps is not None:
        keys, key_of = key_table(timesteps, mask)
        flat_keys = key_of.reshape(-1)
        by_key = np.argsort(flat_keys, kind="stable")  # grouped by key, (sample, step) order inside a group
        bounds = np.searchsorted(flat_keys[by_key], np.arange(keys.size + 1))
        for key in range(keys.size - 1, -1, -1):  # denoising order: large t first
            entries = by_key[bounds[key] : bounds[key + 1]]
            at = np.unique(entries % width)
            groups.append((int(at[0]) if at.size == 1 else None, float(keys[key]), entries))
    else:
        use = np.ones(rollout.shape, dtype=bool) if mask is None else mask
        for pos in np.flatnonzero(use.any(axis=0)):
            groups.append((int(pos), None, np.flatnonzero(use[:, pos]) * width + pos))
    for pos, key, entries in groups:
        with np.errstate(invalid="ignore"):
            delta = np.subtract(flat_trainer[entries], flat_rollout[entries], dtype=np.float64)
        sample = entries // width
        group = np.cumsum(np.r_[True, sample[1:] != sample[:-1]]) - 1  # entries come in sample order
        view = StatisticView(
            delta,
            sides=lambda entries=entries: (flat_rollout[entries], flat_trainer[entries]),
            per_sample=lambda group=group, delta=delta: (np.bincount(group, weights=delta), np.bincount(group)),
            advantages=None if adv is None else lambda sample=sample: adv[sample],
            clips=tables.clips,
        )
        yield pos, key, view


# ----------------------------------------------------------------------------------------------------
def percentile(values: np.ndarray, q: float) -> Any:
    """``np.percentile(values, q, axis=-1)`` (linear method), bit for bit, finding only the two order statistics
    it interpolates between: the entries at or above a threshold drawn from a subsample, then a partition of
    those (a full partition when the threshold was too high). NaN anywhere in a row gives NaN, as NumPy does."""
    rows = np.atleast_2d(values)
    out = np.array([_percentile_row(row, q) for row in rows])
    return out.reshape(values.shape[:-1]) if values.ndim > 1 else float(out[0])


def _percentile_row(row: np.ndarray, q: float) -> float:
    n = row.size
    if n == 0:
        raise ValueError("percentile of an empty view")
    if np.isnan(row).any():
        return math.nan
    virtual = (n - 1) * (q / 100)
    if virtual >= n - 1:  # NumPy takes the last order statistic and measures gamma from index -1
        lower_index = upper_index = n - 1
        gamma = virtual + 1
    else:
        lower_index = math.floor(virtual)
        upper_index = lower_index + 1
        gamma = virtual - lower_index
    lower, upper = _order_statistics(row, lower_index, upper_index)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, as NumPy gives
        difference = upper - lower
        result = lower + difference * gamma
        if gamma >= 0.5:
            result = upper - difference * (1 - gamma)
    return float(result)


def _order_statistics(row: np.ndarray, lower: int, upper: int) -> tuple[np.float64, np.float64]:
    """The `lower`-th and `upper`-th smallest entries of `row` (0-based; no NaN in `row`)."""
    n = row.size
    above = n - lower  # entries at or above the lower order statistic
    if n > 4096 and above * 8 < n:
        stride = n // 2048
        sample = np.sort(row[::stride])
        # Enough entries above the threshold with room to spare: about twice the need in the subsample.
        at = max(0, sample.size - 1 - 2 * (above // stride + 1) - 8)
        candidates = row[row >= sample[at]]
        if candidates.size >= above:
            offset = candidates.size - above
            part = np.partition(candidates, (offset, offset + upper - lower))
            return part[offset], part[offset + upper - lower]
    part = np.partition(row, (lower, upper))
    return part[lower], part[upper]
