# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The ``schedule`` guard read back: the trainer's own scheduler could not look up a timestep the rollout stored
(`rollout_consistency.gate.judging.verdict.unscorable_reason`), so the trainer scored nothing of the batch.

Which schedule each side's timesteps come from is recovered by rebuilding it: the family's scheduler config
(the model directory's, else `rollout_consistency.adapters.ModelFamily.scheduler_config`) under one ``mu`` (a config with dynamic shifting:
Qwen-Image, FLUX) or one ``shift`` (SD3, Wan), over the pipelines' ``linspace(1, 1/N, N)`` sigmas or diffusers'
own ``set_timesteps(N)``, bisected until it holds every timestep of the side (within float32 rounding). Both
recovered and different: `schedule-shift`, with both values (and, for ``mu``, the image sequence length each is
``calculate_shift`` of). The trainer's scheduler holding every timestep the rollout stored: the trainer asked
for values off it (`model-input`). Otherwise the doctor says what it could not tell.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rollout_consistency.gate.judging.causes import Diagnosis
from rollout_consistency.gate.judging.verdict import unscorable_timesteps

from .catalogue import guard_cause

__all__ = ["from_schedule_guard"]

#: Two timesteps are one schedule entry within this, relative (float32 rounding of a value computed another way).
_SAME_TIMESTEP = 1e-6
#: Bisection steps on the shift parameter (each rebuilds the schedule, ~1 ms).
_BISECTIONS = 48


def from_schedule_guard(message: str, config: Mapping[str, Any], stored: Sequence[float]) -> Diagnosis | None:
    """The cause of a failed ``schedule`` guard, from its reason `message`, the report's `config` and the
    timesteps the rollout stored (`stored`, the report's per-timestep rows); None when `message` is not one."""
    read = unscorable_timesteps(message)
    if read is None:
        return None
    asked, schedule = read
    rollout = sorted({*stored, *asked}, reverse=True)
    head = (
        f"schedule guard: the trainer's scheduler holds {len(schedule)} timesteps ({_listing(schedule)}); it was "
        f"asked for {_listing(sorted(set(asked), reverse=True))}, which it does not hold, and scored nothing"
    )
    if stored and all(_held(t, schedule) for t in stored):
        return guard_cause(
            "model-input",
            "The trainer's scheduler holds the rollout's schedule, but the trainer looks it up with timesteps off it.",
            [head, f"every timestep the rollout stored ({_listing(stored)}) is in the trainer's schedule"],
        )
    family, scheduler = _family_config(config)
    steps = int(config.get("num_inference_steps") or len(schedule))
    build = None if scheduler is None else _Schedules(scheduler, steps)
    fits = (None, None) if build is None else (_fit(build, rollout), _fit(build, schedule))
    if fits[0] is None or fits[1] is None:
        why = "no scheduler config of its family is known"
        if build is not None:
            side = "the rollout's" if fits[0] is None else "the trainer's"
            why = f"{side} timesteps are of no {_parameter(build)} of {family}'s scheduler config"
        return guard_cause(
            "different-computation",
            "The trainer's scheduler holds other timesteps than the rollout stored; which schedule each is was not "
            "recovered.",
            [head, f"the rollout stored {_listing(stored)}; not recovered: {why}"],
        )
    name = _parameter(build)
    rollout_says = f"the rollout's timesteps are {family}'s scheduler with {_value(build, fits[0], rollout)}"
    trainer_says = f"the trainer's with {_value(build, fits[1], schedule)}"
    over = {True: f" over linspace(1, 1/{steps}, {steps}) sigmas", False: f" over set_timesteps({steps})"}
    return guard_cause(
        "schedule-shift",
        f"The two sides step on different sigma schedules: their schedulers were set up with another {name}.",
        [head, f"{rollout_says}{over[fits[0][1]]}; {trainer_says}{over[fits[1][1]]}"],
        details={"facts": {"schedule": {"parameter": name, "rollout": fits[0][0], "trainer": fits[1][0]}}},
    )


def _family_config(config: Mapping[str, Any]) -> tuple[str, Mapping[str, Any] | None]:
    """The family's name and the scheduler config the plan was built from: the model directory's own, else the
    family's released one (None when neither is known)."""
    from rollout_consistency.adapters import get_family  # the adapters load diffusers: only when a guard failed
    from rollout_consistency.adapters.families import load_scheduler_config

    name = str(config.get("model_family") or "")
    try:
        family = get_family(name)
    except (KeyError, ValueError):
        return name or "its family", None
    if config.get("model_path"):
        try:
            return name, load_scheduler_config(config["model_path"])
        except (OSError, ValueError):
            return name, None
    return name, family.scheduler_config


def _parameter(build: _Schedules) -> str:
    return "mu" if build.dynamic else "shift"


def _value(build: Any, fit: tuple[float, bool], values: Sequence[float]) -> str:
    """``mu 0.4873 (calculate_shift of 4 image tokens)`` or ``shift 3``: a sequence length is named only where the
    schedule its ``mu`` gives holds every one of `values` too."""
    value, sigmas = fit
    if not build.dynamic:
        return f"shift {value:.4g}"
    from rollout_consistency.schedulers import image_seq_len_shift

    slope = image_seq_len_shift(1, build.config) - image_seq_len_shift(0, build.config)
    tokens = round((value - image_seq_len_shift(0, build.config)) / slope)
    exact = tokens > 0 and all(_held(v, build(sigmas, image_seq_len_shift(tokens, build.config))) for v in values)
    return f"mu {value:.4g}" + (f" (calculate_shift of {tokens} image tokens)" if exact else "")


def _fit(build: Any, values: Sequence[float]) -> tuple[float, bool] | None:
    """``(mu or shift, whether over the pipelines' sigmas)`` whose schedule holds every one of `values`; None if none."""
    # The first timestep (σ = 1) is every shift's: it says nothing of the parameter.
    top = float(build.config.get("num_train_timesteps", 1000))
    inner = [v for v in values if 0.0 < v < top * (1.0 - _SAME_TIMESTEP)]
    if not inner:
        return None
    for sigmas in (True, False):
        for index in range(1, build.steps):
            value = _bisect(build, sigmas, index, inner[0])
            if value is not None and all(_held(v, build(sigmas, value)) for v in values):
                return value, sigmas
    return None


def _bisect(build: Any, sigmas: bool, index: int, target: float) -> float | None:
    """The parameter whose schedule's entry `index` is `target` (entries grow with it), or None out of range."""
    low, high = (-10.0, 10.0) if build.dynamic else (math.log(1e-3), math.log(1e3))

    def as_value(x: float) -> float:  # a shift is bisected on its logarithm
        return x if build.dynamic else math.exp(x)

    def entry(x: float) -> float:
        return build(sigmas, as_value(x))[index]

    if not entry(low) <= target <= entry(high):
        return None
    for _ in range(_BISECTIONS):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if entry(middle) < target else (low, middle)
    return as_value(0.5 * (low + high))


class _Schedules:
    """The timesteps of one scheduler config set up for `steps` steps under a given mu (dynamic shifting) or
    shift (the config's, which also places diffusers' own sigma range), over the pipelines' ``linspace(1, 1/N, N)``
    sigmas or the scheduler's own; a fresh scheduler each call (~0.5 ms)."""

    def __init__(self, config: Mapping[str, Any], steps: int) -> None:
        self.config, self.steps = config, steps
        self.dynamic = bool(config.get("use_dynamic_shifting"))
        self.sigmas = np.linspace(1.0, 1.0 / steps, steps).tolist()  # as the pipelines pass them

    def __call__(self, sigmas: bool, value: float) -> list[float]:
        from rollout_consistency.schedulers import FlowMatchSDEDiscreteScheduler

        scheduler = FlowMatchSDEDiscreteScheduler.from_config(
            dict(self.config) if self.dynamic else {**self.config, "shift": value}
        )
        scheduler.set_timesteps(self.steps, sigmas=self.sigmas if sigmas else None, mu=value if self.dynamic else None)
        return [float(t) for t in scheduler.timesteps.tolist()]


def _held(value: float, schedule: Sequence[float]) -> bool:
    return any(abs(value - t) <= _SAME_TIMESTEP * max(1.0, abs(t)) for t in schedule)


def _listing(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.6g}" for v in values)
