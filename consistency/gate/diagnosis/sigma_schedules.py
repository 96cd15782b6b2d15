# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What a side's sigma schedule is: read from the timesteps it fed its model, shifted, and its shift recovered.

Every shift users write is a scaling of the odds σ/(1 − σ): DanceGRPO's ``sd3_time_shift(shift, t)`` =
``shift·t / (1 + (shift − 1)·t)``, diffusers' static ``shift`` and its exponential dynamic shifting with ``mu``
(odds × e^mu). So two schedules built from one base with two shifts differ by one odds factor (`shifted`), and a
schedule's shift is recovered (`recover_shift`) only where one of the bases the field builds from reproduces
every entry:

* ``linspace(1, 0, N + 1)`` (DanceGRPO; diffusers' FLUX / Qwen-Image pipelines pass ``linspace(1, 1/N, N)``, the
  same first N entries) with an odds factor: the time shift ``s`` (= e^mu for dynamic shifting);
* diffusers' default ``set_timesteps(N)`` with a static ``shift``: ``linspace(1, σ_min, N)`` shifted, where
  ``σ_min`` is the training schedule's last sigma under the same shift.

A schedule built another way (Karras, a terminal stretch, a list of its own) has no recovered shift; the evidence
then quotes the two sequences' first differing entries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

#: Two sigmas are one schedule entry within float32 rounding of a value computed another way.
SAME_SIGMA = 1e-6
#: A shift is recovered when the base it names reproduces every given entry within this (float32 arithmetic).
RECOVERED = 2e-6


def shifted(sigma: float, shift: float) -> float:
    """`sigma` with its odds scaled by `shift` (1 and 0 stay where they are)."""
    if shift == 1.0 or sigma <= 0.0 or sigma >= 1.0:
        return sigma
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def shift_schedule(sigmas: Sequence[float], shift: float) -> list[float]:
    return [shifted(s, shift) for s in sigmas]


def timestep_unit(values: Sequence[float]) -> float:
    """The factor from sigma to the timesteps a model was fed: 1000 for ``σ·1000`` (SD3, DanceGRPO's FLUX loop
    before its ``/ 1000``), 1 for ``σ`` (Qwen-Image, FLUX as diffusers feeds them)."""
    return 1000.0 if max((abs(v) for v in values), default=0.0) > 1.5 else 1.0


def odds_ratio(a: float, b: float) -> float | None:
    """``odds(b) / odds(a)``, None where either is not strictly inside (0, 1)."""
    if not (0.0 < a < 1.0 and 0.0 < b < 1.0):
        return None
    return (b / (1.0 - b)) / (a / (1.0 - a))


def estimate_shift(reference: Sequence[float], own: Mapping[int, float]) -> float:
    """The odds factor that maps `reference` (a schedule's sigmas by step) nearest to `own` (a side's sigmas by
    step, as read from its timesteps): the median of the per-step ratios; 1 when none is informative."""
    ratios = sorted(
        r
        for step, sigma in own.items()
        if 0 <= step < len(reference)
        for r in [odds_ratio(reference[step], sigma)]
        if r is not None
    )
    return ratios[len(ratios) // 2] if ratios else 1.0


def _linear_base(steps: int) -> list[float]:
    return [1.0 - k / steps for k in range(steps)]


def _static_base(steps: int, shift: float) -> list[float]:
    """diffusers' ``set_timesteps(N)`` before its shift: ``linspace(σ_max, σ_min, N)`` of the shifted training
    schedule (``num_train_timesteps`` 1000)."""
    low = shifted(1e-3, shift)
    if steps == 1:
        return [1.0]
    return [1.0 + (low - 1.0) * k / (steps - 1) for k in range(steps)]


def recover_shift(own: Mapping[int, float], steps: int) -> tuple[float, str] | None:
    """``(shift, how the schedule was built)`` when one base reproduces every entry of `own` (sigmas by step of
    an `steps`-step schedule) within `RECOVERED`, from at least two entries strictly inside (0, 1); else None."""
    inner = {k: s for k, s in own.items() if 0.0 < s < 1.0 and 0 <= k < steps}
    if len(inner) < 2:
        return None
    base = _linear_base(steps)
    first = min(inner)
    shift = odds_ratio(base[first], inner[first])
    if shift is not None and all(abs(shifted(base[k], shift) - s) <= RECOVERED for k, s in own.items()):
        return shift, f"linspace(1, 0, {steps + 1})"
    # diffusers' static shift: σ_k(shift) grows with the shift; bisect on its logarithm from one entry.
    low, high = math.log(1e-2), math.log(1e2)
    if not _static_base(steps, 1.0)[first] < 1.0:
        return None
    for _ in range(80):
        middle = 0.5 * (low + high)
        s = math.exp(middle)
        if shifted(_static_base(steps, s)[first], s) < inner[first]:
            low = middle
        else:
            high = middle
    shift = math.exp(0.5 * (low + high))
    base = _static_base(steps, shift)
    if all(abs(shifted(base[k], shift) - s) <= RECOVERED for k, s in own.items()):
        return shift, f"diffusers' set_timesteps({steps})"
    return None


def first_difference(a: Mapping[int, float], b: Mapping[int, float]) -> int | None:
    """The first step at which two sigma sequences differ beyond float32 rounding (None: they agree)."""
    return next((k for k in sorted(set(a) & set(b)) if abs(a[k] - b[k]) > SAME_SIGMA * max(1.0, abs(a[k]))), None)


def describe(own: Mapping[int, float], steps: int, at: int) -> str:
    """A side's schedule in words: its recovered shift when there is one, and its sigma at step `at`."""
    recovered = recover_shift(own, steps)
    value = f"σ{_subscript(at)}={own[at]:.6g}"
    if recovered is None:
        return value
    shift, base = recovered
    return f"shift {shift:.4g} over {base} ({value})"


def _subscript(k: int) -> str:
    return str(k).translate(str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉"))
