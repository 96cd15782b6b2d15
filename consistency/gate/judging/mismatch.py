# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Mismatch statistics beyond ``ratio_mean`` and ``ppo_kl``: the figures LLM trainers log for the
rollout/trainer gap, overall and per timestep. Reported, not gated.

With ``Δ = logp_trainer − logp_rollout`` and ``w = exp(Δ)`` (the importance weight π_trainer/π_rollout of a
sample drawn by the rollout), every figure is pooled over the ``(sample, step)`` entries of its view — not a
mean of per-micro-batch cells as the gated trainer figures are:

=========================  ===================================================================================
``k3_kl``                  ``mean(w − 1 − Δ)``: Schulman's k3 estimator of KL(π_rollout ‖ π_trainer), ≥ 0 per
                           entry (verl's ``low_var_kl`` form, without its clamp)
``chi2``                   ``mean((w − 1)²)``: χ² divergence of the weights (verl rollout correction's
                           variance proxy)
``ess``                    ``mean(w)² / mean(w²)`` = ``1 / mean(w̃²)`` with ``w̃ = w / mean(w)``: the
                           self-normalised effective sample size as a fraction of the entries, in (0, 1]; 1 =
                           perfect agreement (verl's ``rollout_is_eff_sample_size``, scale-invariant)
``p99_abs_dlogp``          99th percentile of ``|Δ|`` (linear interpolation, NumPy's default)
``max_abs_dlogp``          max of ``|Δ|``
``pearson_logp``           Pearson correlation of the two log-prob tables over the entries (NaN when either
                           side is constant: a correlation is undefined then). verl's
                           ``rollout_actor_probs_pearson_corr`` correlates token *probabilities*; a diffusion
                           log-prob is a per-dimension mean of a Gaussian log-density, so the log-probs are
                           correlated here
``bias``                   signed mean of ``Δ``, with the sample as the unit: the mean over samples of each
                           sample's mean ``Δ`` (= ``−ppo_kl`` when every sample has every step and one cell)
``bias_ci_low/high``       its 95 % confidence interval, ``bias ± 1.96·s/√n`` over the ``n`` per-sample means
                           (normal approximation; steps of one sample share its latents, so the sample, not the
                           entry, is the independent unit). NaN with fewer than 2 samples
=========================  ===================================================================================

When advantages ``A`` (one per sample) are given, the advantage-dependent clip fractions of LLM verl's
``compute_policy_loss`` are added (the diffusion trainers — verl-omni's diffusion actor and Flow-GRPO —
count clipping without advantages; those are the gated ``pg_clipfrac*`` figures):

=========================  ===================================================================================
``pg_clipfrac_adv``        verl ``actor/pg_clipfrac``: fraction where the clipped objective is active,
                           ``(A > 0 and w > 1 + ε_high) or (A < 0 and w < 1 − ε_low)``
``pg_clipfrac_dual``       verl ``actor/pg_clipfrac_lower``: dual-clip fraction, ``A < 0 and max(w, clip(w)) >
                           clip_ratio_c`` (default ``clip_ratio_c`` 3)
=========================  ===================================================================================

Non-finite log-probs propagate: a NaN entry makes every figure of its view NaN (the verdict's ``finite``
guard names it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

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
