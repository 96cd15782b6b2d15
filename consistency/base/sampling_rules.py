# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What a rollout's sampling settings must be, checked in one place.

The adapters' `rollout_consistency.adapters.SamplingSettings` (which every rollout, step-wise engine,
trajectory and vLLM-omni batch goes through) and the checker's `rollout_consistency.gate.config.CheckConfig`
both call [`sampling_problem`]; no other module repeats these rules. (The scheduler's own `step` takes
``noise_level = 0`` as the deterministic Euler step, a different rule for a different call.) This module
imports nothing, so the settings can use it without loading torch.
"""

from __future__ import annotations

import difflib
import math
from typing import Any

__all__ = ["SDE_TYPES", "sampling_problem"]

#: The SDE steps (`rollout_consistency.schedulers.SDE_TYPES`, here without importing torch; a test pins them).
SDE_TYPES: tuple[str, ...] = ("sde", "cps", "dance_sde")


def sampling_problem(noise_level: Any, sde_type: Any, guidance_scale: Any = 1.0) -> str | None:
    """The one-line error naming the fix for the first bad sampling setting, or None when all are usable.

    Rules: ``noise_level`` a finite number > 0 (at 0 every step is a deterministic ODE step with no log-prob);
    ``sde_type`` one of [`SDE_TYPES`]; ``guidance_scale`` a finite number.
    """
    if not (_number(noise_level) and math.isfinite(noise_level) and noise_level > 0):
        return (
            f"'noise_level' is {noise_level!r}: with noise_level 0 every step is a deterministic ODE step and carries "
            f"no log-prob, so there is nothing to check. Use the run's SDE noise level (a finite number > 0)."
        )
    if sde_type not in SDE_TYPES:
        lowered = difflib.get_close_matches(str(sde_type).lower(), SDE_TYPES, n=1, cutoff=0.5)
        hint = f" Did you mean {lowered[0]!r}?" if lowered else ""
        return f"'sde_type' is {sde_type!r}; expected one of {', '.join(SDE_TYPES)}.{hint}"
    if not (_number(guidance_scale) and math.isfinite(guidance_scale)):
        return f"'guidance_scale' is {guidance_scale!r}; use a finite number (1 = no guidance)."
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
