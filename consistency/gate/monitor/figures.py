# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""One training step's figures, from sufficient statistics that merge across shards bit for bit.

`StepStats.from_tables(rollout_log_probs, trainer_log_probs, ...)` reads one step's tables (or one shard's rows of
them) into sums, counts and maxima; ``a.merge(b)`` adds two shards; `figures()` turns the statistics into the
step's `StepFigures`. Every sum is an `ExactSum` (exact, any order), so the figures of shards merged in any order
equal the figures of the whole batch in one process **bit for bit**, on the condition that each sample (row) lies
whole in one shard — its per-sample sums (``Σ_t``, added in a fixed pairwise order of the columns in float64) is then the same in
both. Counts are integers and maxima are exact.

With ``Δ = logp_trainer − logp_rollout`` (float64, exact for float32 inputs) and ``w = exp(Δ)``, every figure
is pooled over the step's valid entries (not the gate's mean of per-micro-batch cells):

=====================  ==============================================  ====================================
figure                 definition                                      logged as (whose definition)
=====================  ==============================================  ====================================
``mean_abs_dlogp``     mean ``|Δ|``                                    ``rollout_corr/logprob_abs_diff_mean``
``max_abs_dlogp``      max ``|Δ|``                                     ``rollout_corr/logprob_abs_diff_max``
``ratio_mean``         ``1 + mean(expm1(Δ))``                          ours
``ratio_std``          population std of ``w``                         ours
``ppo_kl``             mean ``−Δ``                                     ``rollout_corr/kl`` (verl)
``approx_kl``          ``½·mean(Δ²)``                                  ours (Flow-GRPO's definition)
``pg_clipfrac``        fraction with ``w − 1 > ε_high`` or ``1 − w >   ours
                       ε_low``; ``_higher`` / ``_lower`` each side
``k3_kl``              ``mean(w − 1 − Δ)``                             ``rollout_corr/k3_kl`` (verl)
``chi2_token``         ``mean(expm1(2·clamp(Δ, ±20)))``                ``rollout_corr/chi2_token`` (verl)
``chi2_seq``           mean over samples of ``expm1(2·clamp(Σ_t Δ))``  ``rollout_corr/chi2_seq`` (verl)
``bias``               mean over samples of each sample's mean ``Δ``   ours
``bias_se``            standard error of ``bias`` over samples         ours
``ppl_ratio``          mean over samples of ``exp(−mean_t Δ)``          ``rollout_corr/ppl_ratio`` (verl)
``log_ppl_diff``       ``−bias``                                       ``rollout_corr/log_ppl_diff`` (verl)
``log_ppl_abs_diff``   mean over samples of ``|mean_t Δ|``             ``rollout_corr/log_ppl_abs_diff``
=====================  ==============================================  ====================================

and per timestep value ``t`` (grouped by the schedule's value, never by window column, as verl-omni does):
``mean_abs_dlogp`` and ``max_abs_dlogp``, logged as ``rollout_corr/logprob_abs_diff/ts_<label>`` (`timestep_label`:
verl-omni's ``.4g``, less the exponent's ``+``). The monitor logs verl's names under its own prefix
(``monitor/rollout_corr/...``), never bare: a verl-omni trainer logs the bare names itself. Counts: ``entries``
(valid entries), ``samples`` (rows with one), ``nonfinite`` (entries where a side is NaN or ±inf: left out of the
sums, and every figure of their step — or timestep — is NaN, so nothing is averaged away).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_consistency.gate.judging.aliasing import shares_memory
from rollout_consistency.gate.judging.metrics import clip_ranges
from rollout_consistency.gate.judging.views import flag_table, float_table

from . import _SERVED_BY
from .exact_sum import ExactSum

#: verl's clamp of log-ratios before exp in χ² (``SAFETY_BOUND``).
SAFETY_BOUND = 20.0

#: The step's figures, in report order.
FIGURE_NAMES: tuple[str, ...] = (
    "mean_abs_dlogp",
    "max_abs_dlogp",
    "ratio_mean",
    "ratio_std",
    "ppo_kl",
    "approx_kl",
    "pg_clipfrac",
    "pg_clipfrac_higher",
    "pg_clipfrac_lower",
    "k3_kl",
    "chi2_token",
    "chi2_seq",
    "bias",
    "bias_se",
    "ppl_ratio",
    "log_ppl_diff",
    "log_ppl_abs_diff",
)
#: The counts every `StepFigures` carries beside its figures.
COUNT_NAMES: tuple[str, ...] = ("entries", "samples", "nonfinite")

#: Our figure -> the name verl/verl-omni log the same definition under (on the pair rollout_log_probs /
#: old_log_probs); the others are logged under ``<prefix><figure>``.
VERL_NAMES: Mapping[str, str] = {
    "mean_abs_dlogp": "rollout_corr/logprob_abs_diff_mean",
    "max_abs_dlogp": "rollout_corr/logprob_abs_diff_max",
    "ppo_kl": "rollout_corr/kl",
    "k3_kl": "rollout_corr/k3_kl",
    "chi2_token": "rollout_corr/chi2_token",
    "chi2_seq": "rollout_corr/chi2_seq",
    "ppl_ratio": "rollout_corr/ppl_ratio",
    "log_ppl_diff": "rollout_corr/log_ppl_diff",
    "log_ppl_abs_diff": "rollout_corr/log_ppl_abs_diff",
}
#: verl-omni's per-timestep series: ``rollout_corr/logprob_abs_diff/ts_<timestep_label(t)>``.
VERL_TIMESTEP_PREFIX = "rollout_corr/logprob_abs_diff/ts_"
#: The monitor's per-timestep max |Δlogp|: ``<prefix>max_abs_dlogp_per_ts/ts_<timestep_label(t)>`` (not under
#: ``<prefix>max_abs_dlogp/``: an MLflow file store keeps each name as a file, and ``max_abs_dlogp`` is one).
MAX_TIMESTEP_PREFIX = "max_abs_dlogp_per_ts/ts_"


def timestep_label(t: float) -> str:
    """A timestep value as series names carry it: verl-omni's ``f"{t:.4g}"`` (its rollout_correction.py), less
    the exponent's ``+``, which MLflow refuses in a metric name: 800.0 -> ``800``, 12345.0 -> ``1.234e04``,
    1e-05 -> ``1e-05``. Values equal to 4 significant digits share a label (as in verl-omni)."""
    return f"{float(t):.4g}".replace("e+", "e")


def label_timestep(label: str) -> float | None:
    """The timestep value a series name's label gives (`timestep_label`'s, or verl-omni's ``1.234e+04``), or
    None for a label that is not a number."""
    try:
        return float(label)
    except ValueError:
        return None


#: Sums over entries and over samples a `StepStats` keeps (names of `StepStats.sums`).
_ENTRY_SUMS = ("delta", "delta_sq", "w_minus_1", "w_minus_1_sq", "chi2_token")
_SAMPLE_SUMS = ("sample_mean", "sample_mean_sq", "sample_abs_mean", "ppl", "chi2_seq")


class StepStatsError(ValueError):
    """Tables or statistics that cannot make one step's figures; the message names the fix."""


@dataclass(frozen=True)
class TimestepStats:
    """The statistics of one timestep value: valid entries, non-finite ones, exact ``Σ|Δ|`` and max ``|Δ|``."""

    entries: int = 0
    nonfinite: int = 0
    abs_delta: ExactSum = field(default_factory=ExactSum)
    max_abs: float = 0.0

    def merge(self, other: TimestepStats) -> TimestepStats:
        return TimestepStats(
            self.entries + other.entries,
            self.nonfinite + other.nonfinite,
            self.abs_delta + other.abs_delta,
            max(self.max_abs, other.max_abs),
        )


@dataclass(frozen=True)
class StepFigures:
    """One step's figures (`FIGURE_NAMES`, float; NaN where undefined), its counts, and its per-timestep figures
    ``{t: {"mean_abs_dlogp": .., "max_abs_dlogp": .., "entries": ..}}`` (empty without timesteps)."""

    values: Mapping[str, float]
    entries: int
    samples: int
    nonfinite: int
    by_timestep: Mapping[float, Mapping[str, float]] = field(default_factory=dict)

    def get(self, name: str) -> float:
        if name in COUNT_NAMES:
            return float(getattr(self, name))
        return self.values.get(name, math.nan)

    def scalars(self, prefix: str = "monitor/") -> dict[str, float]:
        """Every figure under ``prefix + name``, verl's name for those that follow verl's definition under
        ``prefix`` too (``prefix + VERL_NAMES[name]``, ``prefix + VERL_TIMESTEP_PREFIX + timestep_label(t)``: never
        the trainer's own bare ``rollout_corr/*`` series), plus the counts: one flat dict for any tracker.

        Timesteps that share a label (equal to 4 significant digits) are logged as one series: their entry-weighted
        mean and their max."""
        if not prefix:
            raise StepStatsError("the monitor's series need a prefix (e.g. 'monitor/'): bare names are the trainer's.")
        out = {f"{prefix}{name}": float(value) for name, value in self.values.items()}
        out.update({f"{prefix}{name}": float(getattr(self, name)) for name in COUNT_NAMES})
        out.update(
            {prefix + verl: float(self.values[name]) for name, verl in VERL_NAMES.items() if name in self.values}
        )
        labels: dict[str, list[Mapping[str, float]]] = {}
        for t, row in self.by_timestep.items():
            labels.setdefault(timestep_label(t), []).append(row)
        for label, rows in labels.items():
            out[f"{prefix}{VERL_TIMESTEP_PREFIX}{label}"] = _pooled_mean(rows)
            out[f"{prefix}{MAX_TIMESTEP_PREFIX}{label}"] = max(float(row["max_abs_dlogp"]) for row in rows)
        return out


def _pooled_mean(rows: list[Mapping[str, float]]) -> float:
    """The mean |Δlogp| of timesteps sharing one label: the one row's, or the entry-weighted mean of several."""
    if len(rows) == 1:
        return float(rows[0]["mean_abs_dlogp"])
    entries = sum(float(row["entries"]) for row in rows)
    if entries == 0:
        return math.nan
    return sum(float(row["mean_abs_dlogp"]) * float(row["entries"]) for row in rows) / entries


def figures_from_scalars(scalars: Mapping[str, float], prefix: str = "monitor/") -> dict[str, float]:
    """The figures a tracker's scalars hold, by our names: ``prefix + name`` or verl's name under the same
    prefix (``prefix + VERL_NAMES[name]``; with ``prefix=""``, verl-omni's own series); where both are present
    they must agree (a `StepStatsError` otherwise). Unknown names are ignored."""
    found: dict[str, float] = {}
    for name in FIGURE_NAMES + COUNT_NAMES:
        verl = VERL_NAMES.get(name)
        for key in (f"{prefix}{name}", None if verl is None else prefix + verl):
            if key is None or key not in scalars:
                continue
            value = float(scalars[key])
            if name in found and not (found[name] == value or (math.isnan(found[name]) and math.isnan(value))):
                raise StepStatsError(f"{key} = {value!r} but another series of {name} holds {found[name]!r}.")
            found[name] = value
    return found


@dataclass(frozen=True)
class StepStats:
    """Sufficient statistics of one step's entries (or one shard's), mergeable bit for bit (module docstring).

    Attributes:
        entries, samples, nonfinite: valid entries, samples with one, entries with a NaN/±inf side.
        sums: exact sums — over entries: ``delta`` (Δ), ``delta_sq``, ``w_minus_1`` (expm1 Δ), ``w_minus_1_sq``,
            ``chi2_token``; over samples: ``sample_mean`` (mean_t Δ), ``sample_mean_sq``, ``sample_abs_mean``,
            ``ppl`` (exp(−mean_t Δ)), ``chi2_seq``; ``abs_delta`` is the sum of the per-timestep ones.
        abs_delta: exact ``Σ|Δ|`` over entries (kept whole when there are no timesteps).
        max_abs: max ``|Δ|`` over finite entries (0 with none).
        clip_higher, clip_lower: entries with ``w − 1 > ε_high`` and with ``1 − w > ε_low``.
        by_timestep: timestep value -> `TimestepStats` (empty without timesteps).
        clip_ratio_low, clip_ratio_high: the ε the clip counts used (shards must agree to merge).
    """

    entries: int
    samples: int
    nonfinite: int
    sums: Mapping[str, ExactSum]
    abs_delta: ExactSum
    max_abs: float
    clip_higher: int
    clip_lower: int
    by_timestep: Mapping[float, TimestepStats]
    clip_ratio_low: float
    clip_ratio_high: float

    @classmethod
    def from_tables(
        cls,
        rollout_log_probs: Any,
        trainer_log_probs: Any,
        *,
        timesteps: Any = None,
        mask: Any = None,
        clip_ratio: float = 1e-4,
        clip_ratio_low: float | None = None,
        clip_ratio_high: float | None = None,
    ) -> StepStats:
        """Read one step's tables (or one shard's whole rows of them).

        Args:
            rollout_log_probs (`(N, T)` float32/float64, NumPy or torch): the rollout's stored log-probs
                (verl-omni's ``rollout_log_probs``, flow_grpo's ``samples["log_probs"]``).
            trainer_log_probs (`(N, T)`): the trainer's first recompute of them before the step's update
                (verl-omni's ``old_log_probs``).
            timesteps (`(N, T)` float, *optional*): each entry's timestep value (per-timestep figures).
            mask (`(N, T)` bool, *optional*): which entries are valid (verl-omni pads shorter windows).
            clip_ratio, clip_ratio_low, clip_ratio_high: the PPO clip range(s) ε for the clip fractions.

        Raises:
            StepStatsError: a table that is not 2-D float32/float64, shapes that differ, the two tables being one
                array (verl-omni's bypass mode sets ``old_log_probs := rollout_log_probs``: a table compared with
                itself proves nothing), non-finite timesteps, or a bad clip range.
        """
        # Asked of the objects as given: a CUDA tensor passed twice becomes two host copies once converted.
        if shares_memory(rollout_log_probs, trainer_log_probs):
            raise StepStatsError(
                "rollout_log_probs and trainer_log_probs are the same memory (verl-omni's bypass mode copies "
                "rollout_log_probs into old_log_probs): pass the trainer's own recompute, or do not monitor this step."
            )
        rollout = float_table(rollout_log_probs, "rollout_log_probs", StepStatsError)
        trainer = float_table(trainer_log_probs, "trainer_log_probs", StepStatsError)
        if rollout.shape != trainer.shape:
            raise StepStatsError(
                f"rollout_log_probs has shape {rollout.shape} but trainer_log_probs has {trainer.shape}: both sides "
                f"must score the same (samples, steps)."
            )
        low, high = clip_ranges(clip_ratio, clip_ratio_low, clip_ratio_high, StepStatsError)
        if mask is None:
            valid = np.ones(rollout.shape, dtype=bool)
        else:
            valid = flag_table(mask, rollout.shape, "mask", StepStatsError)
        steps = None
        if timesteps is not None:
            steps = float_table(timesteps, "timesteps", StepStatsError)
            if steps.shape != rollout.shape:
                raise StepStatsError(f"timesteps has shape {steps.shape}, expected {rollout.shape}.")
            if not np.isfinite(steps[valid]).all():
                raise StepStatsError("timesteps holds NaN or inf; pass the scheduler's timestep of each entry.")
        return _stats(rollout, trainer, valid, steps, (low, high))

    def merge(self, *others: StepStats) -> StepStats:
        """These statistics and `others`' as one step (exact: the order does not matter)."""
        result = self
        for other in others:
            result = _merge(result, other)
        return result

    def figures(self) -> StepFigures:
        """The step's figures (module docstring). A step without a valid entry has every figure NaN."""
        n, s = self.entries, self.samples
        sums = self.sums
        broken = self.nonfinite > 0 or n == 0

        def mean(total: ExactSum, count: int) -> float:
            return math.nan if broken else total.mean(count)

        w1 = mean(sums["w_minus_1"], n)
        w1_sq = mean(sums["w_minus_1_sq"], n)
        bias = mean(sums["sample_mean"], s)
        values = {
            "mean_abs_dlogp": mean(self.abs_delta, n),
            "max_abs_dlogp": math.nan if broken else self.max_abs,
            "ratio_mean": 1.0 + w1,
            "ratio_std": math.sqrt(max(0.0, w1_sq - w1 * w1)) if not broken else math.nan,
            "ppo_kl": -mean(sums["delta"], n) + 0.0,
            "approx_kl": 0.5 * mean(sums["delta_sq"], n),
            "pg_clipfrac": math.nan if broken else (self.clip_higher + self.clip_lower) / n,
            "pg_clipfrac_higher": math.nan if broken else self.clip_higher / n,
            "pg_clipfrac_lower": math.nan if broken else self.clip_lower / n,
            "k3_kl": mean(sums["w_minus_1"] - sums["delta"], n),
            "chi2_token": mean(sums["chi2_token"], n),
            "chi2_seq": mean(sums["chi2_seq"], s),
            "bias": bias,
            "bias_se": _standard_error(sums["sample_mean_sq"], bias, s, broken),
            "ppl_ratio": mean(sums["ppl"], s),
            "log_ppl_diff": -bias + 0.0,
            "log_ppl_abs_diff": mean(sums["sample_abs_mean"], s),
        }
        by_timestep = {}
        for t, row in sorted(self.by_timestep.items(), reverse=True):  # denoising order: high t first
            bad = row.nonfinite > 0 or row.entries == 0
            by_timestep[t] = {
                "mean_abs_dlogp": math.nan if bad else row.abs_delta.mean(row.entries),
                "max_abs_dlogp": math.nan if bad else row.max_abs,
                "entries": float(row.entries),
            }
        return StepFigures(values, n, s, self.nonfinite, by_timestep)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (exact sums as hex integers); `from_dict` reads it back unchanged."""
        return {
            "entries": self.entries,
            "samples": self.samples,
            "nonfinite": self.nonfinite,
            "sums": {name: total.to_text() for name, total in self.sums.items()},
            "abs_delta": self.abs_delta.to_text(),
            "max_abs": self.max_abs,
            "clip_higher": self.clip_higher,
            "clip_lower": self.clip_lower,
            "by_timestep": [
                [t, row.entries, row.nonfinite, row.abs_delta.to_text(), row.max_abs]
                for t, row in self.by_timestep.items()
            ],
            "clip_ratio_low": self.clip_ratio_low,
            "clip_ratio_high": self.clip_ratio_high,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepStats:
        try:
            return cls(
                entries=int(data["entries"]),
                samples=int(data["samples"]),
                nonfinite=int(data["nonfinite"]),
                sums={name: ExactSum.from_text(text) for name, text in data["sums"].items()},
                abs_delta=ExactSum.from_text(data["abs_delta"]),
                max_abs=float(data["max_abs"]),
                clip_higher=int(data["clip_higher"]),
                clip_lower=int(data["clip_lower"]),
                by_timestep={
                    float(t): TimestepStats(int(e), int(b), ExactSum.from_text(a), float(m))
                    for t, e, b, a, m in data["by_timestep"]
                },
                clip_ratio_low=float(data["clip_ratio_low"]),
                clip_ratio_high=float(data["clip_ratio_high"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise StepStatsError(f"not a StepStats dict ({error!r}); write it with StepStats.to_dict().") from error


# ----------------------------------------------------------------------------------------------------
def _stats(
    rollout: np.ndarray, trainer: np.ndarray, valid: np.ndarray, steps: np.ndarray | None, clips: tuple[float, float]
) -> StepStats:
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf is NaN on purpose: counted, left out
        return _stats_of(rollout, trainer, valid, steps, clips)


def _stats_of(
    rollout: np.ndarray, trainer: np.ndarray, valid: np.ndarray, steps: np.ndarray | None, clips: tuple[float, float]
) -> StepStats:
    low, high = clips
    delta = np.subtract(trainer, rollout, dtype=np.float64)
    finite = np.isfinite(delta)  # a NaN/±inf side makes Δ non-finite (inf - inf too)
    everything = bool(valid.all()) and bool(finite.all())
    good = valid if everything else valid & finite
    bad = valid & ~finite
    n = int(good.sum())
    if not everything:
        delta[~good] = 0.0  # left out of every sum; counted in `nonfinite`
    # Every entry sum goes through its rows: Σ_t per sample in a fixed order of the columns (the same in any shard
    # that holds the row), then the exact sum over the samples.
    w1 = np.expm1(delta)
    higher = _count(w1 > high, good, everything)
    lower = _count(-w1 > low, good, everything)
    chi2 = np.clip(delta, -SAFETY_BOUND, SAFETY_BOUND)
    chi2 *= 2.0
    np.expm1(chi2, out=chi2)
    row_sum = _row_sums(delta)
    vectors = [row_sum, _row_sums(np.square(delta)), _row_sums(w1), _row_sums(np.square(w1)), _row_sums(chi2)]
    del w1, chi2
    abs_delta = np.abs(delta)
    max_abs = float(abs_delta.max()) if n else 0.0

    # Per sample: the samples with an entry and none non-finite (a non-finite one makes every figure NaN anyway).
    counts = good.sum(axis=1)
    rows_bad = bad.any(axis=1)
    rows = (counts > 0) & ~rows_bad
    samples = int(((counts > 0) | rows_bad).sum())
    mean_t = row_sum[rows] / counts[rows]
    vectors += [
        mean_t,
        mean_t * mean_t,
        np.abs(mean_t),
        np.exp(-mean_t),
        np.expm1(2.0 * np.clip(row_sum[rows], -SAFETY_BOUND, SAFETY_BOUND)),
    ]
    if steps is None:
        vectors.append(_row_sums(abs_delta))
    totals = ExactSum.each(vectors)
    sums = dict(zip(_ENTRY_SUMS + _SAMPLE_SUMS, totals, strict=False))

    by_timestep: dict[float, TimestepStats] = {}
    if steps is None:
        total = totals[-1]
    else:
        by_timestep, total = _by_timestep(abs_delta, steps, valid, bad)
    return StepStats(
        entries=n,
        samples=samples,
        nonfinite=int(bad.sum()),
        sums=sums,
        abs_delta=total,
        max_abs=max_abs,
        clip_higher=higher,
        clip_lower=lower,
        by_timestep=by_timestep,
        clip_ratio_low=low,
        clip_ratio_high=high,
    )


def _count(flags: np.ndarray, good: np.ndarray, everything: bool) -> int:
    return int(np.count_nonzero(flags if everything else flags & good))


def _row_sums(table: np.ndarray) -> np.ndarray:
    """Σ over each row in float64, in a fixed pairwise order of the columns (elementwise adds only): a row's sum
    does not depend on the rows beside it, so any shard holding the row computes the same bits."""
    if table.shape[1] == 0:
        return np.zeros(table.shape[0], dtype=np.float64)
    while table.shape[1] > 1:
        half = table.shape[1] // 2
        paired = table[:, :half] + table[:, half : 2 * half]
        table = paired if table.shape[1] % 2 == 0 else np.concatenate([paired, table[:, 2 * half :]], axis=1)
    return table[:, 0].astype(np.float64, copy=True)


def _by_timestep(
    abs_delta: np.ndarray, steps: np.ndarray, valid: np.ndarray, bad: np.ndarray
) -> tuple[dict[float, TimestepStats], ExactSum]:
    """Per timestep value: entries, non-finite entries, exact Σ|Δ| and max |Δ| (and the exact Σ|Δ| of all)."""
    columns = steps.shape[1]
    if bool(valid.all()) and steps.shape[0] and bool((steps == steps[0]).all()):
        # One value per column (a window shared by the batch): group whole columns, no entry-wise sort.
        values, column_group = np.unique(steps[0], return_inverse=True)
        inverse = np.broadcast_to(column_group.ravel(), steps.shape).ravel()
        flat_abs, flat_bad = abs_delta.ravel(), bad.ravel()
    else:
        values, inverse = np.unique(steps[valid], return_inverse=True)
        inverse = inverse.ravel()
        flat_abs, flat_bad = abs_delta[valid], bad[valid]
    del columns
    groups = values.size
    totals = ExactSum.grouped(flat_abs, inverse, groups)
    entries = np.bincount(inverse, minlength=groups) - np.bincount(inverse[flat_bad], minlength=groups)
    nonfinite = np.bincount(inverse[flat_bad], minlength=groups)
    maxima = np.zeros(groups, dtype=np.float64)
    np.maximum.at(maxima, inverse, flat_abs)
    found: dict[float, TimestepStats] = {}
    total = ExactSum()
    for g, t in enumerate(values.tolist()):
        found[float(t)] = TimestepStats(int(entries[g]), int(nonfinite[g]), totals[g], float(maxima[g]))
        total = total + totals[g]
    return found, total


def _merge(a: StepStats, b: StepStats) -> StepStats:
    if (a.clip_ratio_low, a.clip_ratio_high) != (b.clip_ratio_low, b.clip_ratio_high):
        raise StepStatsError(
            f"cannot merge statistics made with clip ranges {(a.clip_ratio_low, a.clip_ratio_high)} and "
            f"{(b.clip_ratio_low, b.clip_ratio_high)}; give every shard the same clip_ratio."
        )
    if bool(a.by_timestep) != bool(b.by_timestep) and a.entries and b.entries:
        raise StepStatsError("one shard has timesteps and the other has none; pass timesteps on every shard or none.")
    by_timestep = dict(a.by_timestep)
    for t, row in b.by_timestep.items():
        by_timestep[t] = by_timestep[t].merge(row) if t in by_timestep else row
    return StepStats(
        entries=a.entries + b.entries,
        samples=a.samples + b.samples,
        nonfinite=a.nonfinite + b.nonfinite,
        sums={name: a.sums[name] + b.sums[name] for name in a.sums},
        abs_delta=a.abs_delta + b.abs_delta,
        max_abs=max(a.max_abs, b.max_abs),
        clip_higher=a.clip_higher + b.clip_higher,
        clip_lower=a.clip_lower + b.clip_lower,
        by_timestep=dict(sorted(by_timestep.items())),
        clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high,
    )


def _standard_error(sum_sq: ExactSum, mean: float, count: int, broken: bool) -> float:
    """Standard error of the mean of the per-sample means (ddof 1; NaN below 2 samples)."""
    if broken or count < 2 or not math.isfinite(mean):
        return math.nan
    variance = max(0.0, (sum_sq.mean(count) - mean * mean) * count / (count - 1))
    return math.sqrt(variance / count)


# The names the package face serves from here are declared once, in the face; MAX_TIMESTEP_PREFIX is this module's
# alone (watch_series reads it).
__all__ = [*_SERVED_BY["figures"], "MAX_TIMESTEP_PREFIX"]
