# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Documented bounds of every numeric setting of a step-1 check, checked before anything is allocated.

Each bound is far above any real run (so it never stands in a user's way) and far below what overflows
64-bit arithmetic or exhausts memory while building the plan or the model's inputs. The table is the
documentation: docs/checker.md lists the same numbers (a test keeps them in step).
"""

from __future__ import annotations

from typing import Any

__all__ = ["BOUNDS", "MAX_PIXELS", "MAX_SAMPLES", "check_bounds"]

_I64 = 2**63 - 1

#: setting -> (lowest, highest), inclusive.
BOUNDS: dict[str, tuple[float, float]] = {
    "max_num_seqs": (1, 4096),
    "num_prompts": (1, 65536),
    "num_images_per_prompt": (1, 1024),
    "height": (1, 8192),
    "width": (1, 8192),
    "num_frames": (1, 1024),
    "num_inference_steps": (1, 10000),
    "max_sequence_length": (1, 65536),
    "sde_window_size": (1, 10000),
    "seed": (-(2**63), _I64),  # packed as a signed 64-bit integer when sample seeds are derived
    "global_step": (0, _I64),
    "rollout_batch_size": (1, 65536),
    "micro_batch_size": (1, 65536),
    "workers": (1, 1024),
    "noise_level": (0.0, 100.0),
    "guidance_scale": (0.0, 1000.0),
    "guidance_scale_2": (0.0, 1000.0),
    "boundary_ratio": (0.0, 1.0),
    "true_cfg_scale": (0.0, 1000.0),
    "clip_ratio": (0.0, 100.0),
    "clip_ratio_low": (0.0, 100.0),
    "clip_ratio_high": (0.0, 100.0),
    "calibration_multiple": (1.0, 1e9),
    "ray_timeout_s": (0.1, 3600.0),
}

#: Largest image (height × width) and number of rollouts (num_prompts × num_images_per_prompt) of one check.
MAX_PIXELS = 8192 * 8192
MAX_SAMPLES = 65536


def check_bounds(settings: Any, error: type[Exception]) -> None:
    """Raise `error` naming the first setting of `settings` (a `CheckConfig`) outside its bound."""
    for name, (low, high) in BOUNDS.items():
        value = getattr(settings, name, None)
        if value is None:
            continue
        if not low <= value <= high:
            raise error(f"setting {name!r} is {value}; it must lie in [{_show(low)}, {_show(high)}] (docs/checker.md).")
    if settings.height * settings.width > MAX_PIXELS:
        raise error(f"height x width is {settings.height * settings.width} pixels; at most {MAX_PIXELS} are checked.")
    samples = settings.num_prompts * settings.num_images_per_prompt
    if samples > MAX_SAMPLES:
        raise error(
            f"num_prompts x num_images_per_prompt is {samples} rollouts; at most {MAX_SAMPLES} are checked "
            f"(step 1 needs a few batches, not a whole epoch)."
        )


def _show(value: float) -> str:
    if isinstance(value, int) and abs(value) >= 2**62:
        return "-2**63" if value < 0 else "2**63-1"
    return f"{value:g}" if isinstance(value, float) else str(value)
