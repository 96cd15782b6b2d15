# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Tolerance profiles: how far each step-1 metric may be from perfect agreement.

A limit bounds the metric's *deviation* from agreement: ``|ratio_mean − 1|``, ``|ppo_kl|`` and the value
itself for the others (all non-negative). A metric without a limit is reported but not gated.

Profiles (the reasoning is in docs/checker.md):

``exact``
    Same code on both sides (the torch rollout against the torch trainer, same attention kernel). Every
    limit is 0: bit-for-bit agreement. The scheduler guarantees that scoring a stored float32 sample
    reproduces the log-prob it was drawn with, bit for bit, *given the same model output*; CPU/GPU kernels
    are deterministic for a fixed shape and thread count. So any non-zero ``Δlogp`` means the two sides
    computed a different forward (a dtype round-trip, another RoPE length, another window, a forward that
    depends on its batch-mates, another kernel) — which is exactly what this profile exists to catch.

``kernel``
    Two engines whose attention kernels differ (vLLM-omni rollout against a PyTorch trainer). Derived from
    the published floor of about ``3e-5`` KL left between vLLM-omni and PyTorch attention after every fix:
    the mean-type figures (``|ppo_kl|``, ``|ratio_mean − 1|``, ``mean_abs_dlogp``, ``ratio_std``) may reach
    ``1e-4`` (≈3x the floor, and the tightest common clip range: a shift that large already moves the
    first update to the clip boundary); ``approx_kl`` may reach ``½·(1e-4)²``; one entry's ``|Δlogp|``
    may reach ``1e-3`` (the widest published clip range, used for video; no kernel difference explains a
    step-1 ratio that even those configs clip). Clip fractions are reported, not gated: with
    ``clip_ratio`` below the floor, kernel noise alone clips. These limits are for bfloat16 kernels (the
    published floor's); when both sides compute in float16 or float32 every limit is 8x tighter: kernel
    noise scales with the unit roundoff of the narrowest format in play, and float32 matmuls may run as TF32
    on CUDA (10 mantissa bits against bfloat16's 7: 2^3).

``calibrated``
    The floor measured on *this* setup: the trainer is run against itself with the other attention kernel
    (see ``rollout_consistency.gate.check``), and each limit is ``multiple`` times the floor's own figure (``multiple²``
    for the quadratic ``approx_kl``). Mean-type limits use the larger of the floor's figure and its
    ``mean_abs_dlogp`` (a signed mean near 0 by chance must not make the gate 0). If the kernels agree bit
    for bit here, every limit is 0 and the profile is ``exact``.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .metrics import METRIC_NAMES, MetricValues

PROFILES: tuple[str, ...] = ("exact", "implementation", "kernel", "calibrated")

#: Published KL floor between vLLM-omni and PyTorch attention after every known fix (docs/checker.md).
PUBLISHED_KERNEL_FLOOR_KL = 3e-5
#: `kernel` profile: bound on mean-type figures (≈3x the floor; the tightest common clip range 1e-4).
KERNEL_MEAN_LIMIT = 1e-4
#: `kernel` profile: bound on the spread figures (mean |Δlogp|, ratio_std): a zero-mean kernel noise moves
#: no update, and bf16 attention on small latents spreads up to ~1.2e-4 (scripts/measure_floors.py).
KERNEL_SPREAD_LIMIT = 3e-4
#: `kernel` profile: bound on any single |Δlogp| (the widest published clip range, 1e-3).
KERNEL_MAX_LIMIT = 1e-3
#: `kernel` profile: limits scale by the narrowest dtype either side computes in (module docstring).
KERNEL_DTYPE_SCALE: Mapping[str, float] = {"bfloat16": 1.0, "float16": 0.125, "float32": 0.125}
_MANTISSA_BITS = {"bfloat16": 7, "float16": 10, "float32": 23}
#: `kernel` and `implementation`: root-mean-square |Δlogp| (``approx_kl = ½·rms²``) may reach this many
#: times the mean-type limit (a Gaussian's rms is 1.25x its mean |x|; 2x leaves room for heavier tails).
RMS_TO_MEAN = 2.0
#: `implementation` profile: the same maths in other code, float32 rounding (~1e-7 per log-prob).
IMPLEMENTATION_MEAN_LIMIT = 1e-6
IMPLEMENTATION_MAX_LIMIT = 1e-5
#: `calibrated` profile: default multiple of the measured floor.
DEFAULT_CALIBRATION_MULTIPLE = 4.0

#: Metrics gated by their absolute value (signed figures); the ratio is gated by its distance to 1.
_SIGNED = {"ppo_kl"}
_AROUND_ONE = {"ratio_mean"}


class ToleranceError(ValueError):
    """An unknown profile or metric name, or an invalid limit."""


def deviation(metric: str, value: float) -> float:
    """Distance of `value` from perfect agreement for `metric` (NaN stays NaN)."""
    if metric in _AROUND_ONE:
        return abs(value - 1.0)
    if metric in _SIGNED:
        return abs(value)
    return value


#: Metric names other trainers log, pointing at this checker's name (Flow-GRPO: ``clipfrac_gt_one`` counts
#: ``ratio − 1 > ε``, the *higher* side; ``clipfrac_lt_one`` counts ``1 − ratio > ε``, the lower side).
METRIC_ALIASES: dict[str, str] = {
    "clipfrac": "pg_clipfrac",
    "clipfrac_gt_one": "pg_clipfrac_higher",
    "clipfrac_lt_one": "pg_clipfrac_lower",
    "clipfrac_higher": "pg_clipfrac_higher",
    "clipfrac_lower": "pg_clipfrac_lower",
    "kl": "ppo_kl",
}


def metric_name_hint(name: str) -> str:
    """` This checker calls that metric 'x'.` for a name another trainer uses, else the closest metric name."""
    alias = METRIC_ALIASES.get(str(name).lower())
    if alias is not None:
        return f" This checker calls that metric {alias!r}."
    return closest_name(name, METRIC_NAMES)


def closest_name(name: str, candidates: tuple[str, ...] | list[str]) -> str:
    """` Did you mean 'x'?` suffix for an unknown name, or an empty string."""
    lowered = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(str(name).lower(), list(lowered), n=1, cutoff=0.5)
    return f" Did you mean {lowered[match[0]]!r}?" if match else ""


@dataclass(frozen=True)
class Tolerance:
    """A resolved profile: one limit per gated metric.

    Attributes:
        profile: ``"exact"``, ``"implementation"``, ``"kernel"`` or ``"calibrated"``.
        limits: metric name -> largest allowed deviation; metrics absent here are not gated.
        floor: the measured floor (``calibrated`` only).
        multiple: the floor multiple (``calibrated`` only).
        overridden: metric names whose limit the user set explicitly.
        basis: one line saying where the limits come from.
        pooled: gate the figures over all samples and steps only (per-step figures are reported, not
            gated: a cell of a few samples is too noisy for a limit sized for the pooled figure). ``exact``
            gates every view (0 is 0 everywhere).
    """

    profile: str
    limits: Mapping[str, float]
    floor: MetricValues | None = None
    multiple: float | None = None
    overridden: tuple[str, ...] = ()
    basis: str = ""
    pooled: bool = False

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ToleranceError(f"Unknown profile {self.profile!r}; expected one of {', '.join(PROFILES)}.")
        clean = {}
        for metric, limit in dict(self.limits).items():
            _check_metric(metric)
            clean[metric] = _check_limit(metric, limit)
        # A private copy in deterministic order (METRIC_NAMES), so reports are byte-stable.
        object.__setattr__(self, "limits", {m: clean[m] for m in METRIC_NAMES if m in clean})

    def limit(self, metric: str) -> float | None:
        return self.limits.get(metric)

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile,
            "limits": dict(self.limits),
            "floor": None if self.floor is None else self.floor.to_dict(),
            "multiple": self.multiple,
            "overridden": list(self.overridden),
            "basis": self.basis,
            "pooled": self.pooled,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Tolerance:
        return cls(
            profile=data["profile"],
            limits={k: float(v) for k, v in data["limits"].items()},
            floor=None if data.get("floor") is None else MetricValues.from_dict(data["floor"]),
            multiple=data.get("multiple"),
            overridden=tuple(data.get("overridden", ())),
            basis=data.get("basis", ""),
            pooled=bool(data.get("pooled", False)),
        )


def exact_tolerance() -> Tolerance:
    """Bit-for-bit agreement: every metric's deviation must be exactly 0."""
    return Tolerance(
        "exact",
        {metric: 0.0 for metric in METRIC_NAMES},
        basis="same code on both sides: log-probs must agree bit for bit",
    )


def narrowest_dtype(*dtypes: str) -> str:
    """The dtype with the fewest mantissa bits among `dtypes` (names as in `KERNEL_DTYPE_SCALE`)."""
    return min(dtypes, key=lambda name: _MANTISSA_BITS[name])


def kernel_tolerance(
    mean_limit: float = KERNEL_MEAN_LIMIT,
    max_limit: float = KERNEL_MAX_LIMIT,
    spread_limit: float = KERNEL_SPREAD_LIMIT,
    compute_dtype: str = "bfloat16",
) -> Tolerance:
    """Cross-engine limits derived from the published ~3e-5 attention-kernel KL floor (module docstring),
    scaled for `compute_dtype`, the narrowest dtype either side computes in."""
    if compute_dtype not in KERNEL_DTYPE_SCALE:
        raise ToleranceError(f"compute_dtype {compute_dtype!r}: expected one of {', '.join(KERNEL_DTYPE_SCALE)}.")
    scale = KERNEL_DTYPE_SCALE[compute_dtype]
    mean_limit, max_limit, spread_limit = mean_limit * scale, max_limit * scale, spread_limit * scale
    return Tolerance(
        "kernel",
        _pooled_limits(mean_limit, spread_limit, max_limit),
        basis=(
            f"published vLLM-omni/PyTorch attention floor ~{PUBLISHED_KERNEL_FLOOR_KL:g} KL, {compute_dtype} "
            f"kernels: pooled bias "
            f"(|ppo_kl|, |ratio_mean - 1|) <= {mean_limit:g}, spread (mean |dlogp|, ratio_std) <= "
            f"{spread_limit:g}, rms |dlogp| <= {RMS_TO_MEAN * spread_limit:g}, any |dlogp| <= {max_limit:g}"
        ),
        pooled=True,
    )


def _pooled_limits(mean_limit: float, spread_limit: float, max_limit: float) -> dict[str, float]:
    """Limits on pooled figures: bias (ratio_mean, ppo_kl), spread (ratio_std, mean |dlogp|, approx_kl's rms)."""
    return {
        "ratio_mean": mean_limit,
        "ratio_std": spread_limit,
        "ppo_kl": mean_limit,
        "approx_kl": 0.5 * (RMS_TO_MEAN * spread_limit) ** 2,
        "mean_abs_dlogp": spread_limit,
        "max_abs_dlogp": max_limit,
    }


def implementation_tolerance(
    mean_limit: float = IMPLEMENTATION_MEAN_LIMIT, max_limit: float = IMPLEMENTATION_MAX_LIMIT
) -> Tolerance:
    """Same maths, other code: both sides compute the same float32 transition, in another operation order."""
    return Tolerance(
        "implementation",
        _pooled_limits(mean_limit, mean_limit, max_limit),
        basis=(
            f"same maths, other code (float32 rounding): pooled mean-type figures <= {mean_limit:g}, "
            f"rms |dlogp| <= {RMS_TO_MEAN * mean_limit:g}, any |dlogp| <= {max_limit:g}"
        ),
        pooled=True,
    )


def calibrated_tolerance(
    floor: MetricValues,
    multiple: float = DEFAULT_CALIBRATION_MULTIPLE,
    sources: str = "trainer vs itself, other attention kernel",
) -> Tolerance:
    """Limits at `multiple` times a floor measured on this setup (trainer vs itself, other kernel).

    Args:
        floor: metrics of the trainer against itself with the other attention kernel.
        multiple: how many times the floor a figure may reach (``approx_kl``: ``multiple**2``).
        sources: what the floor measured, for the report's basis line.

    Raises:
        ToleranceError: the floor is not finite or has no entries (a floor that cannot be measured cannot
            calibrate a gate), or `multiple` is not a finite number >= 1.
    """
    if not (isinstance(multiple, (int, float)) and math.isfinite(multiple) and multiple >= 1):
        raise ToleranceError(f"calibration multiple must be a finite number >= 1, got {multiple!r}.")
    if floor.count == 0 or not floor.is_finite():
        raise ToleranceError(
            "the calibration floor is empty or not finite: the trainer against itself with the other attention "
            "kernel produced NaN/Inf or no steps; fix that run before calibrating a gate on it."
        )
    scale = floor.mean_abs_dlogp
    limits = {
        "ratio_mean": multiple * max(deviation("ratio_mean", floor.ratio_mean), scale),
        "ratio_std": multiple * max(floor.ratio_std, scale),
        "ppo_kl": multiple * max(abs(floor.ppo_kl), scale),
        "approx_kl": multiple**2 * floor.approx_kl,
        "mean_abs_dlogp": multiple * scale,
        "max_abs_dlogp": multiple * floor.max_abs_dlogp,
    }
    basis = (
        f"{multiple:g}x the floor measured here ({sources}: "
        f"mean |dlogp| {floor.mean_abs_dlogp:.3g}, max {floor.max_abs_dlogp:.3g})"
    )
    if floor.max_abs_dlogp == 0:
        basis += "; the kernels agree bit for bit on this setup, so every limit is 0 (as `exact`)"
    return Tolerance("calibrated", limits, floor=floor, multiple=float(multiple), basis=basis, pooled=True)


def resolve_tolerance(
    profile: str,
    overrides: Mapping[str, float | None] | None = None,
    *,
    floor: MetricValues | None = None,
    multiple: float = DEFAULT_CALIBRATION_MULTIPLE,
    floor_sources: str | None = None,
    compute_dtype: str = "bfloat16",
) -> Tolerance:
    """The profile's limits with per-metric overrides applied.

    Args:
        profile: ``"exact"``, ``"implementation"``, ``"kernel"`` or ``"calibrated"`` (which needs `floor`).
        overrides: metric -> limit; ``None`` removes the metric's gate (reported only).
        floor, multiple: see [`calibrated_tolerance`]; floor_sources: its ``sources``.
        compute_dtype: the narrowest dtype either side computes in (``kernel`` limits scale with it).
    """
    if profile == "exact":
        base = exact_tolerance()
    elif profile == "kernel":
        base = kernel_tolerance(compute_dtype=compute_dtype)
    elif profile == "implementation":
        base = implementation_tolerance()
    elif profile == "calibrated":
        if floor is None:
            raise ToleranceError("profile 'calibrated' needs the measured floor (run the calibration first).")
        base = (
            calibrated_tolerance(floor, multiple)
            if floor_sources is None
            else calibrated_tolerance(floor, multiple, floor_sources)
        )
    else:
        raise ToleranceError(
            f"Unknown profile {profile!r}; expected one of {', '.join(PROFILES)}.{closest_name(profile, PROFILES)}"
        )
    if not overrides:
        return base
    limits = dict(base.limits)
    for metric, limit in overrides.items():
        _check_metric(metric)
        if limit is None:
            limits.pop(metric, None)
        else:
            limits[metric] = _check_limit(metric, limit)
    return Tolerance(
        base.profile,
        limits,
        floor=base.floor,
        multiple=base.multiple,
        overridden=tuple(m for m in METRIC_NAMES if m in overrides),
        pooled=base.pooled,
        basis=base.basis
        + "; overridden: "
        + ", ".join(f"{m}={overrides[m]!r}" for m in METRIC_NAMES if m in overrides),
    )


def _check_metric(metric: str) -> None:
    if metric not in METRIC_NAMES:
        raise ToleranceError(
            f"Unknown metric {metric!r} in thresholds; expected one of {', '.join(METRIC_NAMES)}."
            f"{metric_name_hint(metric)}"
        )


def _check_limit(metric: str, limit: Any) -> float:
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit < 0:
        raise ToleranceError(f"threshold for {metric!r} must be a finite number >= 0, got {limit!r}.")
    return float(limit)
