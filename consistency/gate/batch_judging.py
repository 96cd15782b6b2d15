# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What both steps of the check judge a run's batches by: the batches' tables stacked in the plan's order and a
profile's limits where no floor is measured (the metrics' settings are `JudgingSettings.metric_settings`).

Step 1 (`rollout_consistency.gate.check`) adds the mismatch statistics, the calibrated floor and the ``exact``
promise; step 2 (`rollout_consistency.gate.weight_sync_check`) judges its second run by these alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .judging.metrics import MetricsInputError
from .judging.settings import JudgingSettings
from .judging.tolerances import Tolerance, resolve_tolerance
from .sides.shared import BatchResult

__all__ = ["stack", "stacked_tables", "unmeasured_tolerance"]


def stacked_tables(results: Sequence[BatchResult]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rollout's and the trainer's ``(N, W)`` float32 log-probs and the ``(N, W)`` timesteps over every batch,
    in the order given (`MetricsInputError` when the batches' windows differ in width)."""
    return (
        stack([r.rollout_log_probs for r in results], "rollout log-probs"),
        stack([r.trainer_log_probs for r in results], "trainer log-probs"),
        stack([r.timesteps for r in results], "timesteps"),
    )


def stack(tables: Sequence[np.ndarray], what: str) -> np.ndarray:
    """`tables` ``(n_i, W)`` one under the other (`MetricsInputError` naming `what` when their widths differ)."""
    widths = {t.shape[1] for t in tables}
    if len(widths) > 1:
        raise MetricsInputError(f"{what} of different window sizes across batches: {sorted(widths)}")
    return np.concatenate(tables, axis=0)


def unmeasured_tolerance(judging: JudgingSettings, profile: str) -> Tolerance:
    """The limits of `profile`, one that needs no floor, under the check's thresholds and compute dtype."""
    return resolve_tolerance(profile, judging.thresholds, compute_dtype=judging.compute_dtype)
