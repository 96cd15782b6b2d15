# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The denoising schedule as data: enough to rebuild the exact sigmas and timesteps of a rollout.

A trajectory stores a [`SchedulerSetup`] (the scheduler config plus the `set_timesteps` arguments) rather
than the timesteps alone, so a trainer anywhere rebuilds the same `FlowMatchSDEDiscreteScheduler`, and the
stored timesteps can be checked against it value for value (the scheduler matches timesteps by exact
equality).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .flow_match_sde import FlowMatchSDEDiscreteScheduler

__all__ = ["SchedulerSetup", "image_seq_len_shift"]


def image_seq_len_shift(image_seq_len: int, config: Mapping[str, Any]) -> float:
    """diffusers' `calculate_shift`: the resolution-dependent `mu` of a dynamically shifted schedule.

    Linear in `image_seq_len` between `(base_image_seq_len, base_shift)` and
    `(max_image_seq_len, max_shift)` of the scheduler config, as the Qwen-Image, FLUX and SD3 pipelines do.
    """
    base_len = config.get("base_image_seq_len", 256)
    max_len = config.get("max_image_seq_len", 4096)
    base_shift = config.get("base_shift", 0.5)
    max_shift = config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + (base_shift - slope * base_len)


@dataclass(frozen=True)
class SchedulerSetup:
    """A FlowMatch scheduler config and the `set_timesteps` call that produced a rollout's schedule.

    Args:
        config: the scheduler config (`dict(scheduler.config)`), JSON-able; keys starting with `_` are dropped.
        num_inference_steps: denoising steps.
        sigmas: custom sigmas passed to `set_timesteps` (as the diffusers pipelines do:
            `linspace(1, 1/N, N)`), or `None` for the scheduler's own.
        mu: dynamic-shift `mu`, required when the config has `use_dynamic_shifting=True`.

    Guarantees: `build()` called twice, in any process, gives bit-identical `timesteps` and `sigmas`
    (float32); the setup round-trips through JSON exactly (`to_json_dict` / `from_json_dict`).
    """

    config: Mapping[str, Any]
    num_inference_steps: int
    sigmas: tuple[float, ...] | None = None
    mu: float | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", {k: v for k, v in dict(self.config).items() if not k.startswith("_")})
        if not isinstance(self.num_inference_steps, int) or self.num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be an int >= 1, got {self.num_inference_steps!r}.")
        if self.sigmas is not None:
            sigmas = tuple(float(s) for s in self.sigmas)
            if len(sigmas) != self.num_inference_steps:
                raise ValueError(f"{len(sigmas)} sigmas for {self.num_inference_steps} steps: pass one sigma per step.")
            object.__setattr__(self, "sigmas", sigmas)
        if self.mu is not None:
            if not math.isfinite(float(self.mu)):
                raise ValueError(f"mu must be finite, got {self.mu!r}.")
            object.__setattr__(self, "mu", float(self.mu))
        if self.config.get("use_dynamic_shifting") and self.mu is None:
            raise ValueError("The scheduler config uses dynamic shifting: pass `mu` (see `image_seq_len_shift`).")

    @classmethod
    def for_pipeline(cls, config: Mapping[str, Any], num_inference_steps: int, image_seq_len: int) -> SchedulerSetup:
        """The schedule the diffusers Qwen-Image / FLUX pipelines use: sigmas `linspace(1, 1/N, N)`, and
        `mu` from the image sequence length when the config shifts dynamically."""
        sigmas = tuple(np.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps).tolist())
        mu = image_seq_len_shift(image_seq_len, config) if config.get("use_dynamic_shifting") else None
        return cls(config=config, num_inference_steps=num_inference_steps, sigmas=sigmas, mu=mu)

    def build(self, device: Any = None) -> FlowMatchSDEDiscreteScheduler:
        """A fresh scheduler with `set_timesteps` applied (a new object each call: schedulers hold state)."""
        scheduler = FlowMatchSDEDiscreteScheduler.from_config(dict(self.config))
        scheduler.set_timesteps(
            num_inference_steps=self.num_inference_steps,
            device=device,
            sigmas=None if self.sigmas is None else list(self.sigmas),
            mu=self.mu,
        )
        if len(scheduler.timesteps) != self.num_inference_steps:
            raise ValueError(
                f"The scheduler produced {len(scheduler.timesteps)} timesteps for num_inference_steps="
                f"{self.num_inference_steps}; this setup does not describe a plain {self.num_inference_steps}-step "
                f"schedule."
            )
        return scheduler

    def scheduler(self) -> FlowMatchSDEDiscreteScheduler:
        """A built scheduler cached on this setup, for the stateless `sample_previous_step` only.

        Shared by every rollout and recompute that use this setup (building one costs ~1 ms). Code that
        needs the scheduler's own state (diffusers' `step`, a step index) takes a fresh `build()`.
        """
        if "scheduler" not in self._cache:
            self._cache["scheduler"] = self.build()
        return self._cache["scheduler"]

    def timesteps(self) -> torch.Tensor:
        """The schedule's timesteps, float32 tensor of shape `(num_inference_steps,)` (cached, CPU)."""
        if "timesteps" not in self._cache:
            self._cache["timesteps"] = self.scheduler().timesteps.to(dtype=torch.float32).clone()
        return self._cache["timesteps"]

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "config": dict(self.config),
            "num_inference_steps": self.num_inference_steps,
            "sigmas": None if self.sigmas is None else list(self.sigmas),
            "mu": self.mu,
        }

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> SchedulerSetup:
        sigmas: Sequence[float] | None = data.get("sigmas")
        return cls(
            config=data["config"],
            num_inference_steps=data["num_inference_steps"],
            sigmas=None if sigmas is None else tuple(sigmas),
            mu=data.get("mu"),
        )
