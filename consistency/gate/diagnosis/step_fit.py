# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Which step settings reproduce each side's log-probs from its own recorded forwards.

When every model call of the two sides agrees and their log-probs still differ, the difference lies in the
step outside the model: the CFG combination (scale, true CFG's per-token rescale, diffusers' ``guidance_rescale``,
a renorm of the whole sample, predictions rounded to bfloat16 before CFG or the step), the noise level, the SDE
type, the sigma schedule (a time shift of the plan's: `rollout_consistency.gate.diagnosis.sigma_schedules`) and
the step index the step is taken at, the log-prob's reduction, normaliser, sign or an offset. The replay recorded, for each (sample, step), the latents
each side fed, each forward's output and (from the next step's forward) the sample the step produced; from
these, every candidate setting gives a log-prob, and the one that reproduces a side's own table is what that
side ran. Measured, not guessed: a side whose table no candidate reproduces is reported as such.

The transitions are those of docs/scheduler.md, evaluated here in float64 independently of the scheduler (so a
bug in the scheduler cannot hide itself):

    sde        std_dev = η·sqrt(σ/(1 − σ̃)), σ̃ = σ_max if σ == 1 else σ; mean = x(1 + std_dev²·dt/(2σ)) +
               v(1 + std_dev²(1 − σ)/(2σ))·dt; std = std_dev·sqrt(−dt)
    cps        std = σ'·sin(ηπ/2); mean = (x − σv)(1 − σ') + (x + (1 − σ)v)·sqrt(σ'² − std²); log_prob = −mean((x' − mean)²)
    dance_sde  mean = x + dt·v + ½η²·dt·(x + (1 − σ)v)/σ; std = η·sqrt(σ − σ')

with ``log_prob = −mean((x' − mean)²)/(2 std²) − log std − ½ log 2π`` for the Gaussian ones (the mean over all
non-batch dimensions; ``sum`` multiplies by their count).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .sigma_schedules import shift_schedule

SDE_TYPES = ("sde", "cps", "dance_sde")
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
#: Units used for a fit (the worst batch has a handful; a large one is subsampled, evenly).
MAX_UNITS = 16
#: Settings changed at most, one at a time, to reproduce a side's table.
MAX_CHANGES = 3
#: A table is reproduced when every entry is within this of it, relative to 1 + |log-prob|: float32 arithmetic
#: leaves ~1e-7; a setting that only explains most of a disagreement leaves far more.
REPRODUCED_RTOL = 1e-5


@dataclass(frozen=True)
class StepSettings:
    """The settings of the step outside the model that one side's log-probs are reproduced with."""

    noise_level: float
    sde_type: str
    guidance: float | None = None  # CFG scale (None: one forward per step)
    cfg_rescale: bool = False  # the combination rescaled to the conditional prediction's norm (true CFG)
    step_offset: int = 0  # the sigma index relative to the step the forward was taken at
    reduction: str = "mean"
    normalizer: bool = True
    negated: bool = False  # the side returns −log p (a loss's sign)
    offset: float = 0.0
    shift: float = 1.0  # the reference sigmas' odds scaled by this factor (another time shift; `sigma_schedules`)
    guidance_rescale: float = 0.0  # diffusers' guidance_rescale φ: toward std(cond) / std(combined)
    cfg_renorm: float = 0.0  # the combination scaled to this multiple of the conditional's norm (whole sample)
    cfg_renorm_max: float = 0.0  # the combination's norm clamped to this multiple of the conditional's (Lumina's)
    rounding: str = ""  # predictions rounded to bfloat16: "outputs" (before CFG), "combined" (before the step)

    @property
    def rounded_before(self) -> str:
        """Where the predictions are rounded to bfloat16: ``"CFG"`` (each pass's, before they are combined) or
        ``"the step"`` (the prediction the step takes: the combination, or the one forward's output); ``""``."""
        if not self.rounding:
            return ""
        return "CFG" if self.rounding == "outputs" and self.guidance is not None else "the step"

    def describe(self) -> str:
        parts = [f"noise_level {self.noise_level:.4g}", f"sde_type {self.sde_type}"]
        if self.guidance is not None:
            parts.append(
                f"CFG scale {self.guidance:.4g}" + (" (rescaled to the conditional norm)" if self.cfg_rescale else "")
            )
        if self.guidance_rescale:
            parts.append(f"guidance_rescale {self.guidance_rescale:.3g} (std of cond / std of combined)")
        if self.cfg_renorm:
            parts.append(f"combined renormalised to {self.cfg_renorm:.3g} × the conditional's norm")
        if self.cfg_renorm_max:
            parts.append(f"combined renormalised to at most {self.cfg_renorm_max:.3g} × the conditional's norm")
        if self.rounding:
            plural = "s" if self.rounded_before == "CFG" else ""
            parts.append(f"noise prediction{plural} rounded to bfloat16 before {self.rounded_before}")
        if self.shift != 1.0:
            parts.append(f"the plan's sigmas time-shifted by {self.shift:.4g}")
        if self.step_offset:
            parts.append(f"sigma of step {'+' if self.step_offset > 0 else ''}{self.step_offset}")
        if self.reduction != "mean":
            parts.append(f"{self.reduction} over the latent")
        if not self.normalizer:
            parts.append("no Gaussian normaliser")
        if self.negated:
            parts.append("negated (−log p)")
        if self.offset:
            parts.append(f"offset {self.offset:+.3g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class UnitData:
    """One (sample, step) as one side computed it: latents `x`, the forward outputs (one per pass, in call
    order), the produced sample `x_next`, the step index, and the side's log-prob for it."""

    x: Any
    outputs: tuple[Any, ...]
    output_shape: tuple[int, ...]
    x_next: Any
    step: int
    log_prob: float


@dataclass(frozen=True)
class SideFit:
    """A side's best settings, the error of its table under them, and under the config's settings."""

    settings: StepSettings
    error: float
    baseline_error: float
    units: int
    relative_error: float = math.inf  # max |fit − table| / (1 + |table|)
    order: int = 0  # which forward of a CFG pair is the negative one (1: the first)

    @property
    def reproduced(self) -> bool:
        """Every entry of the table within `REPRODUCED_RTOL` of the fit."""
        return self.relative_error <= REPRODUCED_RTOL

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": dataclasses.asdict(self.settings),
            "describe": self.settings.describe(),
            "error": self.error,
            "baseline_error": self.baseline_error,
            "units": self.units,
            "relative_error": self.relative_error,
            "reproduced": self.reproduced,
        }


# ----------------------------------------------------------------------------------------------------
def transition(sigma: float, sigma_next: float, sigma_max: float, noise_level: float, sde_type: str):
    """``(a, b, std)`` with mean = a·x + b·v, float64 (see the module docstring)."""
    dt = sigma_next - sigma
    if sde_type == "sde":
        std_dev = noise_level * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
        return (
            1 + std_dev**2 * dt / (2 * sigma),
            (1 + std_dev**2 * (1 - sigma) / (2 * sigma)) * dt,
            std_dev * math.sqrt(-dt),
        )
    if sde_type == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        k = math.sqrt(max(sigma_next**2 - std**2, 0.0))
        return (1 - sigma_next) + k, -sigma * (1 - sigma_next) + (1 - sigma) * k, std
    half = 0.5 * noise_level**2
    return 1 + half * dt / sigma, dt + half * dt * (1 - sigma) / sigma, noise_level * math.sqrt(sigma - sigma_next)


def velocity(unit: UnitData, settings: StepSettings, order: int) -> Any:
    """The velocity the settings combine from the unit's forwards (`order` 1: the first forward is the negative),
    in the order a pipeline applies them: rounding of the predictions, CFG, true CFG's rescale to the conditional
    norm per token, diffusers' ``guidance_rescale``, a renorm of the whole sample, rounding of the combination."""
    import torch

    outputs = unit.outputs
    if settings.rounding == "outputs":  # emulated in bfloat16 arithmetic, as the side's own code computes it
        outputs = tuple(o.to(torch.bfloat16) for o in outputs)
    if settings.guidance is None or len(outputs) < 2:
        combined = outputs[0]
    else:
        cond, uncond = (outputs[1], outputs[0]) if order else (outputs[0], outputs[1])
        combined = uncond + settings.guidance * (cond - uncond)
        if settings.cfg_rescale and unit.output_shape:
            shape = unit.output_shape[1:]
            c, m = cond.reshape(shape), combined.reshape(shape)
            norms = torch.linalg.vector_norm(c, dim=-1, keepdim=True) / torch.linalg.vector_norm(
                m, dim=-1, keepdim=True
            )
            combined = (m * norms).reshape(-1)
        if settings.guidance_rescale:
            rescaled = combined * (cond.std() / combined.std())
            combined = settings.guidance_rescale * rescaled + (1 - settings.guidance_rescale) * combined
        if settings.cfg_renorm:
            combined = combined * (
                settings.cfg_renorm * torch.linalg.vector_norm(cond) / torch.linalg.vector_norm(combined)
            )
        if settings.cfg_renorm_max:
            limit = settings.cfg_renorm_max * torch.linalg.vector_norm(cond)
            norm = torch.linalg.vector_norm(combined)
            if norm >= limit:
                combined = combined * (limit / norm)
    if settings.rounding == "combined":
        combined = combined.to(torch.bfloat16)
    return combined.to(torch.float64)


def log_prob(unit: UnitData, settings: StepSettings, sigmas: Sequence[float], order: int = 0) -> float:
    """One unit's log-prob under `settings` (NaN when the step index leaves the schedule)."""
    return float(_Units([unit], sigmas).log_probs(settings, order)[0])


class _Units:
    """The units of one side, with their second moments cached per velocity: a candidate's log-probs cost a few
    array operations over the units, never a pass over the latents (except a rescaled CFG's scale)."""

    def __init__(self, units: Sequence[UnitData], sigmas: Sequence[float]) -> None:
        self.units = list(units)
        self.sigmas = list(sigmas)
        self.steps = [u.step for u in self.units]
        self.table = np.array([u.log_prob for u in self.units])
        self.numel = np.array([u.x.numel() for u in self.units], dtype=np.float64)
        self.two_pass = all(len(u.outputs) >= 2 for u in self.units)
        self.cache: dict[Any, np.ndarray] = {}

    def log_probs(self, settings: StepSettings, order: int) -> np.ndarray:
        coefficients = self._coefficients(settings)
        if coefficients is None:
            return np.full(len(self.units), math.nan)
        a, b, std = coefficients
        pp, xx, vv, px, pv, xv = self._moments(settings, order)
        mean_sq = np.maximum(pp + a * a * xx + b * b * vv - 2 * a * px - 2 * b * pv + 2 * a * b * xv, 0.0)
        if settings.sde_type == "cps":
            value = -mean_sq
        else:
            if not np.all(std > 0):
                return np.full(len(self.units), math.nan)
            value = -mean_sq / (2 * std * std)
            if settings.normalizer:
                value = value - (np.log(std) + _HALF_LOG_2PI)
        if settings.reduction == "sum":
            value = value * self.numel
        if settings.negated:
            value = -value
        return value + settings.offset

    def error(self, settings: StepSettings, order: int) -> float:
        diff = self.log_probs(settings, order) - self.table
        return float(np.abs(diff).max()) if np.all(np.isfinite(diff)) else math.inf

    def _coefficients(self, settings: StepSettings):
        sigmas = self.sigmas if settings.shift == 1.0 else shift_schedule(self.sigmas, settings.shift)
        rows = {}
        for step in set(self.steps):
            index = step + settings.step_offset
            if not 0 <= index < len(sigmas) - 1:
                return None
            sigma, sigma_next = sigmas[index], sigmas[index + 1]
            if sigma <= sigma_next or sigma <= 0 or (settings.sde_type != "cps" and sigma >= 1 and sigmas[1] >= 1):
                return None
            rows[step] = transition(sigma, sigma_next, sigmas[1], settings.noise_level, settings.sde_type)
        table = np.array([rows[step] for step in self.steps])
        return table[:, 0], table[:, 1], table[:, 2]

    def _moments(self, settings: StepSettings, order: int) -> tuple[np.ndarray, ...]:
        """``mean(x'²), mean(x²), mean(v²), mean(x'x), mean(x'v), mean(xv)`` per unit, for the velocity
        `settings` combine. Plain CFG, ``v = u + g·(c − u)``, is linear in the scale: its moments come from those
        of ``u`` and ``c − u`` (once per order), so fitting the scale costs no pass over the latents."""
        guidance = settings.guidance if self.two_pass else None
        rescale = settings.cfg_rescale and guidance is not None
        if guidance is not None and not rescale and not settings.rounding:
            key = ("plain", order)
            if key not in self.cache:
                rows = []
                for u in self.units:
                    cond, uncond = (u.outputs[1], u.outputs[0]) if order else (u.outputs[0], u.outputs[1])
                    d, p, x = cond - uncond, u.x_next, u.x
                    pairs = ((p, p), (x, x), (uncond, uncond), (uncond, d), (d, d), (p, x), (p, uncond), (p, d))
                    means = [float(uncond.mean()), float(d.mean()), float(cond.mean()), float((cond * cond).mean())]
                    rows.append([float((a * b).mean()) for a, b in (*pairs, (x, uncond), (x, d))] + means)
                self.cache[key] = np.array(rows).T
            pp, xx, uu, ud, dd, px, pu, pd, xu, xd, mu, md, mc, cc = self.cache[key]
            g = guidance
            vv, pv, xv = uu + 2 * g * ud + g * g * dd, pu + g * pd, xu + g * xd
            # guidance_rescale and a renorm scale the combination by one factor per unit: its moments scale along.
            scale = np.ones_like(vv)
            if settings.guidance_rescale:
                mv = mu + g * md
                ratio = np.sqrt(np.maximum(cc - mc * mc, 0.0) / np.maximum(vv - mv * mv, 1e-300))
                scale = 1 - settings.guidance_rescale + settings.guidance_rescale * ratio
            if settings.cfg_renorm:  # norms over sqrt(numel), as the moments are means
                scale = settings.cfg_renorm * np.sqrt(cc) / np.maximum(np.sqrt(vv), 1e-300)
            if settings.cfg_renorm_max:
                norm, limit = scale * np.sqrt(vv), settings.cfg_renorm_max * np.sqrt(cc)
                scale = np.where(norm >= limit, scale * limit / np.maximum(norm, 1e-300), scale)
            return pp, xx, vv * scale * scale, px, pv * scale, xv * scale
        key = (
            guidance,
            rescale,
            settings.guidance_rescale,
            settings.cfg_renorm,
            settings.cfg_renorm_max,
            settings.rounding,
            order if guidance is not None else 0,
        )
        if key not in self.cache:
            rows = []
            for u in self.units:
                v, p, x = velocity(u, settings, order), u.x_next, u.x
                rows.append([float((a * b).mean()) for a, b in ((p, p), (x, x), (v, v), (p, x), (p, v), (x, v))])
            self.cache[key] = np.array(rows).T
        return tuple(self.cache[key])


# ----------------------------------------------------------------------------------------------------
def fit_side(
    units: Sequence[UnitData], baseline: StepSettings, sigmas: Sequence[float], *, min_offset: float = 0.0
) -> SideFit | None:
    """The settings that best reproduce the units' log-probs: from `baseline`, up to `MAX_CHANGES` changes of
    one setting each (each kept only if it halves the error), then a constant offset (when it stands out of
    the residuals and is at least `min_offset`: float32 arithmetic leaves offsets of a few ULP); None without
    units."""
    chosen = _subsample([u for u in units if u.x_next is not None and math.isfinite(u.log_prob)])
    if not chosen:
        return None
    batch = _Units(chosen, sigmas)
    base = dataclasses.replace(baseline, guidance=baseline.guidance if batch.two_pass else None)
    # Conventions (which forward is the negative one, a rescaled combination) are tried, the baseline's first,
    # only until one reproduces the table.
    starts = [base]
    if batch.two_pass:
        starts.append(dataclasses.replace(base, cfg_rescale=not base.cfg_rescale))
    orders = (0, 1) if batch.two_pass else (0,)
    good_enough = 1e-6 * (1 + float(np.abs(batch.table).max()))
    best: tuple[float, StepSettings, int] = (math.inf, base, 0)
    baseline_error = math.inf
    for start, order in ((start, order) for start in starts for order in orders):
        if best[0] <= good_enough:
            break
        current, error = start, batch.error(start, order)
        baseline_error = min(baseline_error, error)
        for _ in range(MAX_CHANGES):
            if error <= good_enough:
                break
            trials = [(batch.error(c, order), c) for c in _candidates(batch, current, order)]
            trial_error, trial = min(trials, key=lambda item: item[0])
            if not trial_error < 0.5 * error:
                break
            current, error = trial, trial_error
        if error < best[0] * (1 - 1e-9):
            best = (error, current, order)
    error, settings, order = best
    if not math.isfinite(error):
        return SideFit(settings, error, baseline_error, len(chosen))
    residuals = batch.table - batch.log_probs(settings, order)
    mean = float(residuals.mean())
    spread = float(np.abs(residuals - mean).max())
    if abs(mean) > 4 * spread and abs(mean) >= min_offset and abs(mean) > 1e-9 * (1 + float(np.abs(batch.table).max())):
        settings = dataclasses.replace(settings, offset=mean)
        error = spread
    relative = float(np.max(np.abs(batch.log_probs(settings, order) - batch.table) / (1 + np.abs(batch.table))))
    return SideFit(settings, error, baseline_error, len(chosen), relative, order)


def unit_error(unit: UnitData, settings: StepSettings, sigmas: Sequence[float], order: int = 0) -> float:
    """|log-prob under `settings` − the unit's own| / (1 + |its own|) (inf where the settings leave the schedule)."""
    value = log_prob(unit, settings, sigmas, order)
    return abs(value - unit.log_prob) / (1 + abs(unit.log_prob)) if math.isfinite(value) else math.inf


def _subsample(units: list[UnitData]) -> list[UnitData]:
    if len(units) <= MAX_UNITS:
        return units
    stride = len(units) / MAX_UNITS
    return [units[int(i * stride)] for i in range(MAX_UNITS)]


def _candidates(batch: _Units, start: StepSettings, order: int):
    def fitted(settings: StepSettings, name: str, low: float, high: float) -> StepSettings:
        return dataclasses.replace(settings, **{name: _fit(batch, settings, order, name, low, high)})

    yield fitted(start, "noise_level", 1e-3, 4.0)
    for sde_type in SDE_TYPES:
        if sde_type != start.sde_type:
            changed = dataclasses.replace(start, sde_type=sde_type)
            yield changed
            yield fitted(changed, "noise_level", 1e-3, 4.0)
    yield fitted(start, "shift", 1e-2, 1e2)
    if start.guidance is not None:
        yield fitted(start, "guidance", 0.0, 4 * start.guidance + 4)
        yield dataclasses.replace(start, cfg_rescale=not start.cfg_rescale)
        if not start.cfg_rescale and not start.rounding:  # scales of the combination: cheap to fit
            yield fitted(start, "guidance_rescale", 0.0, 1.0)
            yield fitted(start, "cfg_renorm", 0.25, 16.0)
            yield fitted(start, "cfg_renorm_max", 0.25, 16.0)
        elif start.cfg_rescale and not start.rounding:  # a renorm of the whole sample in place of the per-token one
            yield fitted(dataclasses.replace(start, cfg_rescale=False), "cfg_renorm", 0.25, 16.0)
            yield fitted(dataclasses.replace(start, cfg_rescale=False), "cfg_renorm_max", 0.25, 16.0)
    for rounding in ("outputs", "combined") if start.guidance is not None and batch.two_pass else ("outputs",):
        if rounding != start.rounding:
            yield dataclasses.replace(start, rounding=rounding)
    for offset in (-1, 1):
        yield dataclasses.replace(start, step_offset=start.step_offset + offset)
    yield dataclasses.replace(start, reduction="sum" if start.reduction == "mean" else "mean")
    yield dataclasses.replace(start, normalizer=not start.normalizer)
    yield dataclasses.replace(start, negated=not start.negated)


def _fit(batch: _Units, start: StepSettings, order: int, name: str, low: float, high: float) -> float:
    """The value of `name` in ``[low, high]`` minimising the squared error: a grid, then golden sections (fewer
    for a rescaled CFG scale, whose every value costs a pass over the latents)."""

    def loss(value: float) -> float:
        diff = batch.log_probs(dataclasses.replace(start, **{name: value}), order) - batch.table
        return float(diff @ diff) if np.all(np.isfinite(diff)) else math.inf

    costly = name == "guidance" and (start.cfg_rescale or bool(start.rounding))
    count, rounds = (16, 24) if costly else (48, 50)
    if low > 0:
        grid = [low * (high / low) ** (i / count) for i in range(count + 1)]
    else:
        grid = [low + (high - low) * i / count for i in range(count + 1)]
    values = [loss(g) for g in grid]
    # A log-density is not monotonic in the std (−A/η² − log η meets a value twice), so the squared error can hold
    # a shallow basin beside the sharp one the true value sits in: refine the grid's best local minima, not only
    # its lowest point.
    last = len(grid) - 1
    minima = [
        i for i in range(len(grid)) if values[i] <= values[max(i - 1, 0)] and values[i] <= values[min(i + 1, last)]
    ]
    ratio = (math.sqrt(5) - 1) / 2
    best = (math.inf, grid[0])
    for i in sorted(minima, key=values.__getitem__)[:3]:
        a, b = grid[max(i - 1, 0)], grid[min(i + 1, last)]
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        loss_c, loss_d = loss(c), loss(d)
        for _ in range(rounds):  # one new evaluation per round: the kept point is the next round's other one
            if loss_c <= loss_d:
                b, d, loss_d = d, c, loss_c
                c = b - ratio * (b - a)
                loss_c = loss(c)
            else:
                a, c, loss_c = c, d, loss_d
                d = a + ratio * (b - a)
                loss_d = loss(d)
        value = (a + b) / 2
        best = min(best, (loss(value), value))
    return best[1]
