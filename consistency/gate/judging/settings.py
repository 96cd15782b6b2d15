# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""[`JudgingSettings`]: what the judgement of a step-1 check knows of its settings, as one frozen object.

Two parts: how the two sides differ (what `rollout_consistency.gate.judging.tolerance_model` reads to list the
legitimate sources of difference and what ``exact`` can promise), and how the figures are gated (the profile, the
limits, the clip ranges and the trainer's micro-batch `compute_metrics` aggregates by). The check builds it once,
from its `CheckConfig` (`CheckConfig.judging`); judging never sees the `CheckConfig` itself, which sits a layer
above it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["JudgingSettings"]


@dataclass(frozen=True)
class JudgingSettings:
    """The settings the judgement reads (every field as the `CheckConfig` resolves it).

    The two sides:
        rollout_backend, trainer_backend: registered backend names or plug-in specs (``"package.module:factory"``).
        rollout_attention, trainer_attention, rollout_dtype, trainer_dtype: each side's attention kernel and
            transformer dtype.
        rollout_from_file: the rollout is a saved trajectory file (no batch composition to compare).
        batch_invariant, step_execution, max_num_seqs: how the rollout batches its forwards.
        rollout_batch_size, micro_batch_size: the rollout's batch and the trainer's micro-batch (resolved).
        trainer_step_implementation: the trainer's SDE-step code (``"reference"``: the rollout's).

    The gate:
        profile: the resolved tolerance profile. thresholds: per-metric limit overrides (None: report only).
        clip_ratio, clip_ratio_low, clip_ratio_high: the PPO clip range(s). calibration_multiple: the
        ``calibrated`` limit in multiples of the floor. compute_dtype: the narrowest dtype either side computes in.
    """

    rollout_backend: str
    trainer_backend: str
    rollout_attention: str
    trainer_attention: str
    rollout_dtype: str
    trainer_dtype: str
    rollout_from_file: bool
    batch_invariant: bool
    step_execution: bool
    max_num_seqs: int
    rollout_batch_size: int
    micro_batch_size: int
    trainer_step_implementation: str
    profile: str
    clip_ratio: float
    clip_ratio_low: float | None
    clip_ratio_high: float | None
    calibration_multiple: float
    compute_dtype: str
    thresholds: Mapping[str, float | None] = field(default_factory=dict)

    @property
    def metric_settings(self) -> dict[str, float | int | None]:
        """The keyword settings of `compute_metrics` (clip ranges, the trainer's micro-batch)."""
        return dict(
            clip_ratio=self.clip_ratio,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            micro_batch_size=self.micro_batch_size,
        )
