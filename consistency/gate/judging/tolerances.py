# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Tolerance profiles: how far each step-1 metric may be from perfect agreement.

A limit bounds the metric's *deviation* from agreement: ``|ratio_mean − 1|``, ``|ppo_kl|`` and the value
itself for the others (all non-negative). A metric without a limit is reported but not gated.

Each profile is a `Profile` in the `PROFILES` registry: its name (the settings', flags' and reports' string), what
it promises, its limit for a metric — from the metric's `scale` (a bias, a spread, its rms form, one entry's
maximum, a fraction) — and the behaviour the rest of the gate asks it about instead of comparing names:
``pooled`` (gate the pooled figures only), ``needs_floor`` (the checker measures a floor in the same run; a pair
of tables cannot have one), ``bit_exact`` (say first when the configuration cannot have it), ``unmeasured``
(the profile to use where no floor can be measured: the step-2 check).

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

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rollout_consistency.base.registry import Registry, closest_name

from .metrics import METRICS, Metric, MetricValues

__all__ = [
    "PROFILES",
    "LimitContext",
    "Profile",
    "Tolerance",
    "ToleranceError",
    "calibrated_tolerance",
    "closest_name",
    "deviation",
    "exact_tolerance",
    "get_profile",
    "kernel_tolerance",
    "metric_name_hint",
    "narrowest_dtype",
    "resolve_tolerance",
    "table_profiles",
]

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
#: What the `calibrated` floor measures unless the caller says otherwise.
DEFAULT_FLOOR_SOURCES = "trainer vs itself, other attention kernel"


class ToleranceError(ValueError):
    """An unknown profile or metric name, or an invalid limit."""


def deviation(metric: str, value: float) -> float:
    """Distance of `value` from perfect agreement for `metric` (NaN stays NaN)."""
    return METRICS[metric].deviation(value)


def metric_aliases() -> dict[str, str]:
    """Metric names other trainers log, pointing at this checker's name (Flow-GRPO: ``clipfrac_gt_one`` counts
    ``ratio − 1 > ε``, the *higher* side; ``clipfrac_lt_one`` counts ``1 − ratio > ε``, the lower side)."""
    return {alias: metric.name for metric in METRICS.values() for alias in metric.aliases}


def metric_name_hint(name: str) -> str:
    """` This checker calls that metric 'x'.` for a name another trainer uses, else the closest metric name."""
    alias = metric_aliases().get(str(name).lower())
    if alias is not None:
        return f" This checker calls that metric {alias!r}."
    return closest_name(name, METRICS.names())


# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LimitContext:
    """What a profile's limits may depend on.

    Attributes:
        compute_dtype: the narrowest dtype either side's forward runs in (``kernel`` scales with it).
        floor: the figures of the difference measured on this setup (profiles that `need_floor`).
        multiple: how many floors a figure may reach.
        floor_sources: what the floor measured, for the basis line.
    """

    compute_dtype: str = "bfloat16"
    floor: MetricValues | None = None
    multiple: float = DEFAULT_CALIBRATION_MULTIPLE
    floor_sources: str = DEFAULT_FLOOR_SOURCES


@dataclass(frozen=True)
class Profile:
    """A tolerance profile: what agreement it promises, and how far each metric may be from it.

    The string `name` is the profile's face in settings, flags and reports; the object carries the behaviour.

    Attributes:
        name: ``profile = "..."`` in a config, ``--profile`` on the command line, ``tolerance.profile`` in JSON.
        promises: one line for the docs: what a PASS under it means.
        limit: a metric's largest allowed deviation under this profile (None: reported, not gated), from the
            metric's `Metric.scale` and the context.
        basis: the report's ``limits:`` line, where the limits come from.
        pooled: gate the figures over all samples and steps only (per-step figures are reported, named on a
            FAIL, not gated); ``False`` gates every view.
        needs_floor: its limits need a floor measured in the same run (the checker's second trainer pass):
            refused for a pair of tables, replaced by `unmeasured` where no floor can be measured.
        bit_exact: it promises bit-for-bit agreement (the report says first when the configuration cannot have
            it, and a rounding-sized FAIL explains itself).
        unmeasured: the profile to use where this one's floor cannot be measured (default: itself).
        validate: raises `ToleranceError` for a context this profile cannot use (e.g. a floor that is not finite).
    """

    name: str
    promises: str
    limit: Callable[[Metric, LimitContext], float | None]
    basis: Callable[[LimitContext], str]
    pooled: bool = True
    needs_floor: bool = False
    bit_exact: bool = False
    unmeasured: str = ""
    validate: Callable[[LimitContext], None] | None = None

    def __post_init__(self) -> None:
        if not self.unmeasured:
            object.__setattr__(self, "unmeasured", self.name)

    def tolerance(self, context: LimitContext | None = None) -> Tolerance:
        """The resolved limits of every registered metric under this profile."""
        context = context or LimitContext()
        if self.needs_floor and context.floor is None:
            raise ToleranceError(f"profile {self.name!r} needs the measured floor (run the calibration first).")
        if self.validate is not None:
            self.validate(context)
        limits = {}
        for metric in METRICS.values():
            limit = self.limit(metric, context)
            if limit is not None:
                limits[metric.name] = limit
        return Tolerance(
            self.name,
            limits,
            floor=context.floor if self.needs_floor else None,
            multiple=float(context.multiple) if self.needs_floor else None,
            basis=self.basis(context),
            pooled=self.pooled,
        )


#: The tolerance profiles by name. A new profile is one `Profile` and one `PROFILES.register` call: settings,
#: flags, the checker, `gate()` and the reports accept its name.
PROFILES: Registry[Profile] = Registry("profile")


def get_profile(name: str) -> Profile:
    """The registered profile called `name` (ToleranceError naming the known ones and the closest)."""
    profile = PROFILES.get(name)
    if profile is None:
        raise ToleranceError(PROFILES.unknown(name))
    return profile


def table_profiles() -> tuple[str, ...]:
    """The profiles a pair of tables can be gated under: those that need no floor measured in the same run."""
    return tuple(p.name for p in PROFILES.values() if not p.needs_floor)


def limit_by_scale(metric: Metric, *, bias: float, spread: float, max_: float) -> float | None:
    """A pooled profile's limit from the metric's scale: a bias, a spread (its rms form quadratic), one entry's
    maximum; fractions are reported, not gated (with a clip range below the floor, noise alone clips)."""
    if metric.scale == "bias":
        return bias
    if metric.scale == "spread":
        return spread
    if metric.scale == "rms":
        return 0.5 * (RMS_TO_MEAN * spread) ** 2
    if metric.scale == "max":
        return max_
    return None


def narrowest_dtype(*dtypes: str) -> str:
    """The dtype with the fewest mantissa bits among `dtypes` (names as in `KERNEL_DTYPE_SCALE`)."""
    return min(dtypes, key=lambda name: _MANTISSA_BITS[name])


def _kernel_scale(compute_dtype: str) -> float:
    if compute_dtype not in KERNEL_DTYPE_SCALE:
        raise ToleranceError(f"compute_dtype {compute_dtype!r}: expected one of {', '.join(KERNEL_DTYPE_SCALE)}.")
    return KERNEL_DTYPE_SCALE[compute_dtype]


def _kernel_basis(mean_limit: float, spread_limit: float, max_limit: float, compute_dtype: str) -> str:
    return (
        f"published vLLM-omni/PyTorch attention floor ~{PUBLISHED_KERNEL_FLOOR_KL:g} KL, {compute_dtype} "
        f"kernels: pooled bias "
        f"(|ppo_kl|, |ratio_mean - 1|) <= {mean_limit:g}, spread (mean |dlogp|, ratio_std) <= "
        f"{spread_limit:g}, rms |dlogp| <= {RMS_TO_MEAN * spread_limit:g}, any |dlogp| <= {max_limit:g}"
    )


def _implementation_basis(mean_limit: float, max_limit: float) -> str:
    return (
        f"same maths, other code (float32 rounding): pooled mean-type figures <= {mean_limit:g}, "
        f"rms |dlogp| <= {RMS_TO_MEAN * mean_limit:g}, any |dlogp| <= {max_limit:g}"
    )


def _calibrated_limit(metric: Metric, context: LimitContext) -> float | None:
    floor, multiple = context.floor, context.multiple
    assert floor is not None  # `Profile.tolerance` refuses a floorless context
    value, scale = floor.get(metric.name), floor.mean_abs_dlogp
    if metric.scale == "bias":
        return multiple * max(metric.deviation(value), scale)  # a signed mean near 0 by chance must not gate at 0
    if metric.scale == "spread":
        return multiple * max(value, scale)
    if metric.scale == "rms":
        return multiple**2 * value
    if metric.scale == "max":
        return multiple * value
    return None


def _calibrated_basis(context: LimitContext) -> str:
    floor = context.floor
    assert floor is not None
    basis = (
        f"{context.multiple:g}x the floor measured here ({context.floor_sources}: "
        f"mean |dlogp| {floor.mean_abs_dlogp:.3g}, max {floor.max_abs_dlogp:.3g})"
    )
    if floor.max_abs_dlogp == 0:
        basis += "; the kernels agree bit for bit on this setup, so every limit is 0 (as `exact`)"
    return basis


def _validate_floor(context: LimitContext) -> None:
    multiple, floor = context.multiple, context.floor
    if not (isinstance(multiple, (int, float)) and math.isfinite(multiple) and multiple >= 1):
        raise ToleranceError(f"calibration multiple must be a finite number >= 1, got {multiple!r}.")
    if floor is None or floor.count == 0 or not floor.is_finite():
        raise ToleranceError(
            "the calibration floor is empty or not finite: the trainer against itself with the other attention "
            "kernel produced NaN/Inf or no steps; fix that run before calibrating a gate on it."
        )


EXACT = PROFILES.register(
    Profile(
        "exact",
        "bit-for-bit agreement",
        limit=lambda metric, context: 0.0,
        basis=lambda context: "same code on both sides: log-probs must agree bit for bit",
        pooled=False,
        bit_exact=True,
    )
)
IMPLEMENTATION = PROFILES.register(
    Profile(
        "implementation",
        "the same maths in other code: differences of float32 rounding",
        limit=lambda metric, context: limit_by_scale(
            metric, bias=IMPLEMENTATION_MEAN_LIMIT, spread=IMPLEMENTATION_MEAN_LIMIT, max_=IMPLEMENTATION_MAX_LIMIT
        ),
        basis=lambda context: _implementation_basis(IMPLEMENTATION_MEAN_LIMIT, IMPLEMENTATION_MAX_LIMIT),
    )
)
KERNEL = PROFILES.register(
    Profile(
        "kernel",
        "a difference no larger than an attention-kernel difference",
        limit=lambda metric, context: limit_by_scale(
            metric,
            bias=KERNEL_MEAN_LIMIT * _kernel_scale(context.compute_dtype),
            spread=KERNEL_SPREAD_LIMIT * _kernel_scale(context.compute_dtype),
            max_=KERNEL_MAX_LIMIT * _kernel_scale(context.compute_dtype),
        ),
        basis=lambda context: _kernel_basis(
            KERNEL_MEAN_LIMIT * _kernel_scale(context.compute_dtype),
            KERNEL_SPREAD_LIMIT * _kernel_scale(context.compute_dtype),
            KERNEL_MAX_LIMIT * _kernel_scale(context.compute_dtype),
            context.compute_dtype,
        ),
    )
)
CALIBRATED = PROFILES.register(
    Profile(
        "calibrated",
        "a difference no larger than a multiple of the floor measured in the same run",
        limit=_calibrated_limit,
        basis=_calibrated_basis,
        needs_floor=True,
        unmeasured="kernel",
        validate=_validate_floor,
    )
)


# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """A resolved profile: one limit per gated metric.

    Attributes:
        profile: the profile's name (``"exact"``, ``"implementation"``, ``"kernel"``, ``"calibrated"`` or one
            registered in `PROFILES`).
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
        # A private copy in deterministic order (the registry's), so reports are byte-stable.
        object.__setattr__(self, "limits", {m: clean[m] for m in METRICS if m in clean})

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
    return EXACT.tolerance()


def kernel_tolerance(
    mean_limit: float = KERNEL_MEAN_LIMIT,
    max_limit: float = KERNEL_MAX_LIMIT,
    spread_limit: float = KERNEL_SPREAD_LIMIT,
    compute_dtype: str = "bfloat16",
) -> Tolerance:
    """Cross-engine limits derived from the published ~3e-5 attention-kernel KL floor (module docstring),
    scaled for `compute_dtype`, the narrowest dtype either side computes in."""
    scale = _kernel_scale(compute_dtype)
    mean_limit, max_limit, spread_limit = mean_limit * scale, max_limit * scale, spread_limit * scale
    limits = {m.name: limit_by_scale(m, bias=mean_limit, spread=spread_limit, max_=max_limit) for m in METRICS.values()}
    return Tolerance(
        "kernel",
        {name: limit for name, limit in limits.items() if limit is not None},
        basis=_kernel_basis(mean_limit, spread_limit, max_limit, compute_dtype),
        pooled=True,
    )


def calibrated_tolerance(
    floor: MetricValues,
    multiple: float = DEFAULT_CALIBRATION_MULTIPLE,
    sources: str = DEFAULT_FLOOR_SOURCES,
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
    return CALIBRATED.tolerance(LimitContext(floor=floor, multiple=multiple, floor_sources=sources))


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
        profile: a registered profile's name: ``"exact"``, ``"implementation"``, ``"kernel"`` or
            ``"calibrated"`` (which needs `floor`).
        overrides: metric -> limit; ``None`` removes the metric's gate (reported only).
        floor, multiple: see [`calibrated_tolerance`]; floor_sources: its ``sources``.
        compute_dtype: the narrowest dtype either side computes in (``kernel`` limits scale with it).
    """
    base = get_profile(profile).tolerance(
        LimitContext(
            compute_dtype=compute_dtype,
            floor=floor,
            multiple=multiple,
            floor_sources=DEFAULT_FLOOR_SOURCES if floor_sources is None else floor_sources,
        )
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
    named = [m for m in METRICS if m in overrides]
    return Tolerance(
        base.profile,
        limits,
        floor=base.floor,
        multiple=base.multiple,
        overridden=tuple(named),
        pooled=base.pooled,
        basis=base.basis + "; overridden: " + ", ".join(f"{m}={overrides[m]!r}" for m in named),
    )


def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ToleranceError(
            f"Unknown metric {metric!r} in thresholds; expected one of {', '.join(METRICS)}.{metric_name_hint(metric)}"
        )


def _check_limit(metric: str, limit: Any) -> float:
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not math.isfinite(limit) or limit < 0:
        raise ToleranceError(f"threshold for {metric!r} must be a finite number >= 0, got {limit!r}.")
    return float(limit)
