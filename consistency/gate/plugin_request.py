# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""[`RolloutRequest`]: one rollout batch of the plan, as a rollout plug-in receives it.

The plug-in contract is `rollout_consistency.gate.sides.plugins` (which re-exports this class); the request lives
beside the settings because it carries the check's `CheckConfig` (`RolloutRequest.config`), which the sides, a
layer below the check, never read: they build the request through `SidesSettings.user_code`, which adds it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import CheckConfig

__all__ = ["RolloutRequest"]


@dataclass(frozen=True)
class RolloutRequest:
    """One rollout batch of the plan, as the rollout plug-in receives it.

    Attributes:
        batch: the batch index. sample_indices: global sample indices (``n`` of them).
        seeds: per-sample seed (``n`` ints): initial noise and SDE noise must come from generators seeded
            with them (`rollout_consistency.adapters.rollout` documents the draws the built-in rollout makes).
        prompts: per-sample prompt text. prompt_groups: per-sample prompt-group id.
        windows: per-sample `rollout_consistency.schedulers.SDEWindow` (samples of a group share one).
        conditioning: the family's text conditioning of `prompts` from the checker's encoder, batch-first
            (e.g. Qwen-Image ``prompt_embeds`` ``(n, L, D)`` float32 and ``prompt_embeds_mask`` ``(n, L)``
            int64); use it, or encode `prompts` with your own encoder.
        scheduler_setup: the schedule (`rollout_consistency.schedulers.SchedulerSetup`).
        family: the `rollout_consistency.adapters.ModelFamily`. options: its forward settings.
        guidance_scale: the guidance the family's velocity takes.
        config: every setting (`CheckConfig`): noise_level, sde_type, global_step, ...
    """

    batch: int
    sample_indices: tuple[int, ...]
    seeds: tuple[int, ...]
    prompts: tuple[str, ...]
    prompt_groups: tuple[int, ...]
    windows: tuple[Any, ...]
    conditioning: Mapping[str, Any]
    scheduler_setup: Any
    family: Any
    options: Mapping[str, Any]
    guidance_scale: float
    config: CheckConfig
