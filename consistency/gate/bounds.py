# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The check of every numeric setting of a step-1 check against its documented bound, before anything is allocated.

Each setting's bound is written once, with the setting (`rollout_consistency.gate.config.Setting.bounds`, gathered
in `rollout_consistency.gate.config.BOUNDS`; docs/checker.md lists the same numbers and a test keeps them in step).
Each is far above any real run (so it never stands in a user's way) and far below what overflows 64-bit arithmetic
or exhausts memory while building the plan or the model's inputs. Here: the check, and the two bounds on products
of settings.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MAX_PIXELS", "MAX_SAMPLES", "check_bounds"]

#: Largest image (height × width) and number of rollouts (num_prompts × num_images_per_prompt) of one check.
MAX_PIXELS = 8192 * 8192
MAX_SAMPLES = 65536


def check_bounds(
    values: Mapping[str, object], bounds: Mapping[str, tuple[float, float]], error: type[Exception]
) -> None:
    """Raise `error` naming the first of `values` (setting -> value) outside its inclusive `bounds`, then the
    totals (``height x width``, ``num_prompts x num_images_per_prompt``)."""
    for name, (low, high) in bounds.items():
        value = values.get(name)
        if not isinstance(value, (int, float)):  # None, or a word such as sde_window_size "all"
            continue
        if not low <= value <= high:
            raise error(f"setting {name!r} is {value}; it must lie in [{_show(low)}, {_show(high)}] (docs/checker.md).")
    height, width = values["height"], values["width"]
    if height * width > MAX_PIXELS:
        raise error(f"height x width is {height * width} pixels; at most {MAX_PIXELS} are checked.")
    samples = values["num_prompts"] * values["num_images_per_prompt"]
    if samples > MAX_SAMPLES:
        raise error(
            f"num_prompts x num_images_per_prompt is {samples} rollouts; at most {MAX_SAMPLES} are checked "
            f"(step 1 needs a few batches, not a whole epoch)."
        )


def _show(value: float) -> str:
    if isinstance(value, int) and abs(value) >= 2**62:
        return "-2**63" if value < 0 else "2**63-1"
    return f"{value:g}" if isinstance(value, float) else str(value)
