# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The calibrated floor's tables: the trainer against itself with one source of difference changed at a time.

`rollout_consistency.gate.judging.tolerance_model` says which sources a configuration has and combines their
floors; this module measures them on the worker, beside the trainer's own recompute
(`rollout_consistency.gate.sides.trainer.score_trajectory` calls [`measure_floor_tables`]). [`recompute_variant`]
is also the ``torch`` trainer's recompute under another SDE-step implementation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rollout_consistency.gate.judging.tolerance_model import floor_variants

from .shared import attention

__all__ = ["measure_floor_tables", "recompute_variant"]


def recompute_variant(
    backend: Any,
    trajectory: Any,
    *,
    kernel: str,
    micro_batch_size: int | None = None,
    implementation: str | None = None,
) -> np.ndarray:
    """The trainer's log-probs of every stored step, `(B, W)` float32 numpy, with the given kernel,
    micro-batch size (default: the config's) and SDE-step implementation (default: the config's)."""
    import torch

    from rollout_consistency.adapters import recompute_step_log_prob
    from rollout_consistency.schedulers.flow_grpo_step import step_implementation

    config = backend.config
    micro = micro_batch_size or config.resolved_micro_batch_size
    name = implementation or getattr(config, "trainer_step_implementation", "reference")
    parts = []
    with torch.no_grad(), attention(kernel):
        for start in range(0, trajectory.batch_size, micro):
            part = trajectory.select(range(start, min(start + micro, trajectory.batch_size)))
            step = step_implementation(name, part.scheduler.scheduler())
            columns = [
                recompute_step_log_prob(
                    backend.trainer_model, part, k, family=backend.family, scheduler=step, check=k == 0
                )
                for k in range(part.window_size)
            ]
            parts.append(torch.stack(columns, dim=1))
    return torch.cat(parts).detach().cpu().numpy().copy()


def measure_floor_tables(backend: Any, trajectory: Any) -> dict[str, np.ndarray]:
    """Per source present in the configuration (besides the kernel, which `score_trajectory` measures): the
    trainer's log-probs `(B, W)` float32 with that source changed."""
    config = backend.config
    variants = floor_variants(config.judging, None)
    return {
        source: recompute_variant(backend, trajectory, kernel=config.trainer_attention, **settings)
        for source, settings in variants.items()
    }
