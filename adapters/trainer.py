# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The trainer's side: recompute the log-probs of a trajectory's stored window steps.

Same forward, same stored float32 inputs, same scheduler maths as the rollout: with the same model it
reproduces the rollout's log-probs bit for bit, provided the forward is batch-invariant for the batches
used. The simplest way to guarantee it is to recompute with the rollout's batch composition (micro-batches
of the same rows). Other compositions may take other kernels on this CPU build — a single row takes a
matrix-vector kernel, and some batches of 3 round differently for SD3 — with differences of ~1e-7, see
docs/adapters.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .families import ModelFamily, get_family, model_device
from .trajectory import Trajectory

__all__ = ["check_trajectory_for_model", "recompute_log_probs", "recompute_step_log_prob", "trainer_experts"]


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def check_trajectory_for_model(family: ModelFamily, transformer: nn.Module, trajectory: Trajectory) -> None:
    """ValueError when a trajectory does not fit the model (family, latent shape, conditioning)."""
    if trajectory.model_family != family.name:
        raise ValueError(
            f"The trajectory is from a {trajectory.model_family!r} rollout but the {family.name!r} adapter was asked "
            f"to re-score it; use the {trajectory.model_family!r} family."
        )
    expected = tuple(family.latent_shape(transformer, trajectory.family_options))
    if trajectory.latent_shape != expected:
        raise ValueError(
            f"Stored latents have per-sample shape {trajectory.latent_shape} but this {family.name} transformer with "
            f"family_options {dict(trajectory.family_options)} takes {expected}: wrong latent shape for the model "
            f"(another model config or image size)."
        )
    family.check_conditioning(
        transformer,
        trajectory.conditioning,
        trajectory.batch_size,
        trajectory.guidance_scale,
        trajectory.family_options,
    )


def recompute_step_log_prob(
    transformer: nn.Module,
    trajectory: Trajectory,
    k: int,
    *,
    family: ModelFamily | None = None,
    autocast_dtype: torch.dtype | None = None,
    scheduler: Any = None,
    check: bool = True,
) -> torch.Tensor:
    """Log-prob of stored window step `k` for every sample, `(B,)` float32, differentiable when grad is on.

    Scores `trajectory.latents[:, k+1]` given `trajectory.latents[:, k]` at `trajectory.timesteps[:, k]` with
    the trajectory's conditioning, guidance and noise settings. Gradients reach the transformer through the
    transition mean only (the scored sample is detached). Call under `torch.no_grad()` for a check, or with
    grad enabled and back-propagate step by step to bound memory.

    Args:
        autocast_dtype: run the forward under `torch.autocast(dtype=...)` (a bf16 mixed-precision trainer with
            float32 master weights). `None` runs in the transformer's own dtype (load it in bf16 or fp32).
        scheduler: a built scheduler to use (default: `trajectory.scheduler.scheduler()`, cached on the setup).
        check: validate that the trajectory fits the model first (skip when looping over steps).
    """
    family = family or get_family(trajectory.model_family)
    if check:
        check_trajectory_for_model(family, transformer, trajectory)
    if not 0 <= k < trajectory.window_size:
        raise IndexError(f"Window step {k} out of range for a window of {trajectory.window_size} steps.")
    device = model_device(transformer)
    scheduler = scheduler or trajectory.scheduler.scheduler()
    # Contiguous copies: a (B, W+1, ...) slice is strided, and strided inputs slow every op after it.
    sample = trajectory.latents[:, k].to(device).contiguous()
    prev_sample = trajectory.latents[:, k + 1].to(device).contiguous()
    timestep = trajectory.timesteps[:, k].to(device)
    conditioning = {name: t.to(device) for name, t in trajectory.conditioning.items()}
    with _autocast(device, autocast_dtype):
        velocity = family.velocity(
            transformer,
            sample,
            timestep,
            conditioning,
            trajectory.guidance_scale,
            options=trajectory.family_options,
        )
    velocity = velocity.float()
    out = scheduler.sample_previous_step(
        velocity,
        timestep,
        sample,
        noise_level=trajectory.noise_level,
        sde_type=trajectory.sde_type,
        prev_sample=prev_sample,
        include_normalizer=trajectory.include_normalizer,
    )
    return out.log_prob


def recompute_log_probs(
    transformer: nn.Module,
    trajectory: Trajectory,
    *,
    family: ModelFamily | None = None,
    steps: Sequence[int] | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The trainer's log-probs of the stored window steps, `(B, len(steps))` float32 (all steps by default).

    Same forward, same float32 inputs, same scheduler maths as the rollout: with the same model and batch
    composition the result equals `trajectory.log_probs` bit for bit. Differentiable when grad is enabled
    (the whole graph of all requested steps is kept — for training, loop over
    [`recompute_step_log_prob`] instead).
    """
    family = family or get_family(trajectory.model_family)
    check_trajectory_for_model(family, transformer, trajectory)
    steps = range(trajectory.window_size) if steps is None else list(steps)
    scheduler = trajectory.scheduler.scheduler()
    columns = [
        recompute_step_log_prob(
            transformer, trajectory, k, family=family, autocast_dtype=autocast_dtype, scheduler=scheduler, check=False
        )
        for k in steps
    ]
    return torch.stack(columns, dim=1)


def trainer_experts(
    transformer: nn.Module, trajectory: Trajectory, *, family: ModelFamily | None = None
) -> tuple[tuple[str, ...], ...] | None:
    """Which expert `transformer` scores each stored window step with, per sample (`B` tuples of `W` names), in
    `Trajectory.experts`' layout; `None` for a family or model without experts by timestep.

    It is the same question the velocity asks the model for every forward of `recompute_step_log_prob`, so it
    names what the recompute runs; compare it with `trajectory.experts` (what the rollout ran).
    """
    family = family or get_family(trajectory.model_family)
    if family.experts is None:
        return None
    device = model_device(transformer)
    columns = [
        family.experts(transformer, trajectory.timesteps[:, k].to(device), trajectory.family_options)
        for k in range(trajectory.window_size)
    ]
    if any(column is None for column in columns):
        return None
    return tuple(tuple(column[b] for column in columns) for b in range(trajectory.batch_size))
