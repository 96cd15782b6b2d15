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

from .shared import Backend, attention

__all__ = ["measure_floor_tables", "recompute_variant"]


def recompute_variant(
    backend: Backend,
    trajectory: Any,
    *,
    kernel: str,
    micro_batch_size: int | None = None,
    implementation: str | None = None,
) -> np.ndarray:
    """The trainer's log-probs of every stored step, `(B, W)` float32 numpy, with the given kernel,
    micro-batch size (default: the settings') and SDE-step implementation (default: the settings')."""
    import torch

    from rollout_consistency.adapters import recompute_step_log_prob
    from rollout_consistency.schedulers.flow_grpo_step import step_implementation

    settings = backend.settings
    micro = micro_batch_size or settings.execution.micro_batch_size
    name = implementation or settings.model.trainer_step_implementation
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


def measure_floor_tables(backend: Backend, trajectory: Any) -> dict[str, np.ndarray]:
    """Per source present in the configuration (besides the kernel, which `score_trajectory` measures): the
    trainer's log-probs `(B, W)` float32 with that source changed (`ModelSettings.floor_variants`)."""
    model = backend.settings.model
    return {
        source: recompute_variant(backend, trajectory, kernel=model.trainer_attention, **variant)
        for source, variant in model.floor_variants.items()
    }
