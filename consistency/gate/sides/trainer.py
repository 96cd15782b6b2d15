# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The trainer side: recompute the log-prob of every stored window step, micro-batch by micro-batch, with the
trainer's attention kernel and dtype, and pack both sides' log-probs as one batch's [`BatchResult`].

[`score_trajectory`] is the trainer's half of a batch whatever produced the trajectory (the built-in rollout,
a rollout plug-in, or a saved file). For the ``calibrated`` profile it also recomputes with the trainer's
other attention kernel and once per other source of difference the configuration has
(`rollout_consistency.gate.sides.floor_tables`, the floor's tables; the sources are
`rollout_consistency.gate.judging.tolerance_model`'s).
The recompute itself is the worker's trainer backend (`Backend.trainer_recompute`): for the registered
``torch`` trainer, [`torch_log_probs`] (its factory, [`start`], is registered in
`rollout_consistency.gate.backend_registry`); a trainer plug-in recomputes with its own code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .floor_tables import measure_floor_tables, recompute_variant
from .settings import SidesSettings
from .shared import Backend, BatchResult, attention


def score_trajectory(
    backend: Backend,
    trajectory: Any,
    *,
    batch: int,
    sample_indices: tuple[int, ...],
    seconds: dict[str, float] | None = None,
    forwards: dict[str, int] | None = None,
) -> BatchResult:
    """The trainer side: recompute every stored window step of `trajectory` (and the floor with the other
    kernel, for ``calibrated``), and pack both sides' log-probs as one batch's result.

    `seconds` / `forwards` carry the rollout's own figures when there was a rollout in this process.
    """
    from .rollout_seal import recompute_checked, seal, seal_problems

    settings = backend.settings
    seconds, forwards = dict(seconds or {}), dict(forwards or {})
    cfg_passes = backend.cfg_passes
    # Sealed before the trainer (possibly user code) runs: the tables compared are the rollout's as it made them.
    sealed = seal(trajectory.log_probs, trajectory.timesteps, trajectory, "trajectory")
    start = time.perf_counter()
    trainer, findings = recompute_checked(backend, trajectory, settings.model.trainer_attention)
    seconds["trainer"] = time.perf_counter() - start
    micro = settings.execution.micro_batch_size
    n_micro = -(-trajectory.batch_size // micro)
    forwards["trainer"] = n_micro * trajectory.window_size * cfg_passes

    floor, floor_tables = None, {}
    if backend.floor_kernel is not None:
        start = time.perf_counter()
        floor, _ = recompute_checked(backend, trajectory, backend.floor_kernel)
        floor_tables = measure_floor_tables(backend, trajectory)
        seconds["floor"] = time.perf_counter() - start
        forwards["floor"] = forwards["trainer"] * (1 + len(floor_tables))

    experts = side_experts(
        backend, trajectory
    )  # user code too (a plug-in's experts(batch)): before the seal is checked
    findings += seal_problems(sealed)
    return BatchResult(
        batch=batch,
        sample_indices=sample_indices,
        rollout_log_probs=sealed.log_probs,
        trainer_log_probs=trainer,
        floor_log_probs=floor,
        timesteps=sealed.timesteps,
        window_starts=tuple(w.start for w in trajectory.windows),
        prompt_groups=tuple(trajectory.prompt_groups),
        seeds=tuple(trajectory.seeds),
        forwards=forwards,
        seconds=seconds,
        precision=backend.precision,
        floor_tables=floor_tables,
        weights=backend.weights,
        experts=experts,
        findings=tuple(("distinct", message) for message in findings),
    )


def side_experts(backend: Backend, trajectory: Any) -> dict[str, Any] | None:
    """Which expert each side scored every stored step with (`BatchResult.experts`), or None when neither side
    has experts by timestep. The rollout's is the trajectory's record; the built-in trainer's is its model's
    answer for the stored timesteps; a trainer plug-in's comes from its optional ``experts(batch)``."""
    from rollout_consistency.adapters.trainer import trainer_experts

    if backend.trainer_experts is not None:
        trainer = backend.trainer_experts(backend, trajectory, (trajectory.batch_size, trajectory.window_size))
    else:
        trainer = trainer_experts(backend.trainer_model, trajectory, family=backend.family)
    if trajectory.experts is None and trainer is None:
        return None
    return {"rollout": trajectory.experts, "trainer": trainer}


def trainer_log_probs(backend: Backend, trajectory: Any, kernel: str) -> np.ndarray:
    """The trainer's log-probs of every stored step, micro-batch by micro-batch: `(B, W)` float32 numpy."""
    return backend.trainer_recompute(backend, trajectory, kernel)


def start(settings: SidesSettings) -> Callable[[Backend, Any, str], np.ndarray]:
    """The ``torch`` trainer backend's registered factory: its recompute, [`torch_log_probs`]."""
    return torch_log_probs


def torch_log_probs(backend: Backend, trajectory: Any, kernel: str) -> np.ndarray:
    """The PyTorch training adapter's log-probs of every stored step (`rollout_consistency.adapters.recompute_log_probs`,
    micro-batch by micro-batch, under attention kernel `kernel`): `(B, W)` float32 numpy."""
    import torch

    from rollout_consistency import adapters

    if backend.settings.model.trainer_step_implementation != "reference":
        return recompute_variant(backend, trajectory, kernel=kernel)
    micro = backend.settings.execution.micro_batch_size
    parts = []
    with torch.no_grad(), attention(kernel):
        for start in range(0, trajectory.batch_size, micro):
            part = trajectory.select(range(start, min(start + micro, trajectory.batch_size)))
            parts.append(adapters.recompute_log_probs(backend.trainer_model, part, family=backend.family))
    return torch.cat(parts).detach().cpu().numpy().copy()
