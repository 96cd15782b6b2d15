# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The SDE window: which denoising steps are stochastic (and carry a log-prob) in one rollout.

Every draw here is a pure function of explicit arguments — the launcher's seed, the global training
step and the prompt-group id. Nothing reads RANK, LOCAL_RANK or any other environment variable, so a run
draws the same windows on 1 GPU or 64, and all rollouts of one prompt group share one window (a window
drawn per request makes the group's reward variance measure timestep bias instead of the policy).
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Literal

WINDOW_KINDS = ("fixed", "random", "progressive")


@dataclass(frozen=True)
class SDEWindow:
    """Contiguous run of SDE steps `[start, start + size)` in a schedule of `num_steps` steps.

    Steps inside the window use the SDE step and carry a log-prob; the others are deterministic Euler
    (ODE) steps.
    """

    start: int
    size: int
    num_steps: int

    def __post_init__(self) -> None:
        for name in ("start", "size", "num_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"SDEWindow.{name} must be an int, got {value!r}.")
        if self.num_steps < 1 or self.size < 1 or self.start < 0 or self.stop > self.num_steps:
            raise ValueError(
                f"SDE window [{self.start}, {self.stop}) does not fit a schedule of {self.num_steps} steps; "
                f"need 0 <= start, size >= 1 and start + size <= num_steps."
            )

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def steps(self) -> range:
        """Step indices inside the window, in denoising order."""
        return range(self.start, self.stop)

    def __contains__(self, step_index: int) -> bool:
        return self.start <= step_index < self.stop


#: The window's key is hashed as signed 64-bit integers: every argument must fit one.
_INT64_MAX = 2**63 - 1


def _check_int(name: str, value: object, minimum: int) -> int:
    if value is None:
        raise ValueError(
            f"`{name}` is required: pass it explicitly from the launcher (it is never read from the "
            f"environment, so that the window does not depend on process placement)."
        )
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}.")
    if value > _INT64_MAX:
        raise ValueError(f"`{name}` must be <= 2**63 - 1 (a signed 64-bit integer), got {value}.")
    return value


def _resolve_range(num_steps: int, window_size: int, window_range: tuple[int, int] | None) -> tuple[int, int]:
    low, high = (0, num_steps) if window_range is None else tuple(window_range)
    if not (0 <= low < high <= num_steps):
        raise ValueError(f"sde_window_range {window_range!r} must satisfy 0 <= low < high <= num_steps ({num_steps}).")
    if window_size > high - low:
        raise ValueError(
            f"sde_window_size {window_size} does not fit sde_window_range [{low}, {high}) "
            f"({high - low} steps); shrink the window or widen the range."
        )
    return low, high


def _uniform_int(low: int, high: int, *key: int) -> int:
    """Uniform integer in [low, high] keyed by `key`: SHA-256 of the packed key, stable on every platform."""
    digest = hashlib.sha256(b"rollout-consistency/sde-window/v1" + struct.pack(f"<{len(key)}q", *key)).digest()
    # 256 random bits modulo a span of a few hundred: the modulo bias is below 2^-240.
    return low + int.from_bytes(digest, "little") % (high - low + 1)


def draw_sde_window(
    *,
    seed: int,
    global_step: int,
    prompt_group: int,
    num_steps: int,
    window_size: int,
    window_range: tuple[int, int] | None = None,
) -> SDEWindow:
    """Draw the SDE window of one prompt group at one training step (Flow-GRPO's per-step random window).

    The start is uniform over the positions that keep the window inside `window_range` and is a pure
    function of the arguments: every rollout of the group, on any rank of any world size, in any process,
    gets the same window.

    Args:
        seed (`int`): the launcher's seed for the run. Required; never read from the environment.
        global_step (`int`): the training iteration (>= 0).
        prompt_group (`int`): the id of the prompt group whose rollouts share the window (>= 0).
        num_steps (`int`): denoising steps in the schedule.
        window_size (`int`): SDE steps in the window (`sde_window_size`).
        window_range (`tuple[int, int]`, *optional*): half-open range of step indices `[low, high)` the
            window must lie in (`sde_window_range`); the whole schedule by default.
    """
    _check_int("seed", seed, -(2**63))
    _check_int("global_step", global_step, 0)
    _check_int("prompt_group", prompt_group, 0)
    _check_int("num_steps", num_steps, 1)
    _check_int("window_size", window_size, 1)
    low, high = _resolve_range(num_steps, window_size, window_range)
    start = _uniform_int(low, high - window_size, seed, global_step, prompt_group)
    return SDEWindow(start=start, size=window_size, num_steps=num_steps)


@dataclass(frozen=True)
class SDEWindowSchedule:
    """How the window moves over a training run.

    Kinds:
        * `"fixed"`: always `[low, low + window_size)` of the range.
        * `"random"`: a fresh window per (global step, prompt group), see [`draw_sde_window`].
        * `"progressive"`: MixGRPO-style sliding window; starts at `low` and advances by `stride` steps
          every `every` iterations, then stays at the end of the range.

    Args:
        kind: one of `"fixed"`, `"random"`, `"progressive"`.
        num_steps: denoising steps in the schedule.
        window_size: SDE steps per window (`sde_window_size`).
        window_range: `[low, high)` the window must lie in (`sde_window_range`); whole schedule if `None`.
        stride: steps the progressive window advances each time.
        every: iterations between two advances of the progressive window.
    """

    kind: Literal["fixed", "random", "progressive"]
    num_steps: int
    window_size: int
    window_range: tuple[int, int] | None = None
    stride: int = 1
    every: int = 1

    def __post_init__(self) -> None:
        if self.kind not in WINDOW_KINDS:
            raise ValueError(f"Unknown SDE window kind {self.kind!r}; expected one of {', '.join(WINDOW_KINDS)}.")
        _check_int("num_steps", self.num_steps, 1)
        _check_int("window_size", self.window_size, 1)
        _check_int("stride", self.stride, 1)
        _check_int("every", self.every, 1)
        _resolve_range(self.num_steps, self.window_size, self.window_range)

    def window(self, *, seed: int, global_step: int, prompt_group: int) -> SDEWindow:
        """The window of `prompt_group` at `global_step` (pure function of the arguments and the schedule)."""
        _check_int("seed", seed, -(2**63))
        _check_int("global_step", global_step, 0)
        _check_int("prompt_group", prompt_group, 0)
        low, high = _resolve_range(self.num_steps, self.window_size, self.window_range)
        if self.kind == "random":
            return draw_sde_window(
                seed=seed,
                global_step=global_step,
                prompt_group=prompt_group,
                num_steps=self.num_steps,
                window_size=self.window_size,
                window_range=(low, high),
            )
        start = low
        if self.kind == "progressive":
            start = min(low + self.stride * (global_step // self.every), high - self.window_size)
        return SDEWindow(start=start, size=self.window_size, num_steps=self.num_steps)
