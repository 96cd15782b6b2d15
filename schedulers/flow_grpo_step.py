# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The same SDE transition written the way Flow-GRPO / DanceGRPO write it: "same maths, other code".

[`FlowMatchSDEDiscreteScheduler`] computes the transition as ``mean = a·x + b·v`` with the coefficients in
float64 and reduces the squared residual in float64 chunks. Trainers written from the papers compute the
same quantities in another order, all in float32 tensors: the mean from its textbook terms, the Gaussian
log-density element by element, then a float32 ``mean`` over the latent. Both are correct; they differ by
float32 rounding (a few 1e-7 of the log-prob). [`FlowGRPOStep`] is that second implementation: the
checker's trainer can use it (``trainer_step_implementation='flow-grpo'``) and the tolerance model
measures it as the "implementation" source of difference (docs/checker.md). It keeps its own arithmetic on
purpose: calling the reference's would make the two agree by construction, and that difference would vanish.
"""

from __future__ import annotations

import math

import torch

from .flow_match_sde import SDE_TYPES, FlowMatchSDEDiscreteScheduler, FlowMatchSDESchedulerOutput

#: Names of the SDE-step implementations the trainer can use.
STEP_IMPLEMENTATIONS: tuple[str, ...] = ("reference", "flow-grpo")


class FlowGRPOStep:
    """`sample_previous_step` of a configured scheduler, computed in Flow-GRPO's operation order.

    Args:
        scheduler: a [`FlowMatchSDEDiscreteScheduler`] after ``set_timesteps`` (its sigmas and timestep
            lookup are used as they are; only the transition is recomputed).

    Shapes and dtypes are those of [`FlowMatchSDEDiscreteScheduler.sample_previous_step`]: float32 in,
    ``prev_sample`` / ``prev_sample_mean`` `(B, ...)` float32, ``log_prob`` and ``prev_sample_std`` `(B,)`
    float32.
    """

    def __init__(self, scheduler: FlowMatchSDEDiscreteScheduler) -> None:
        self.scheduler = scheduler

    def sample_previous_step(
        self,
        model_output: torch.Tensor,
        timestep: float | torch.Tensor,
        sample: torch.Tensor,
        *,
        noise_level: float,
        sde_type: str = "sde",
        prev_sample: torch.Tensor | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        include_normalizer: bool = True,
    ) -> FlowMatchSDESchedulerOutput:
        if sde_type not in SDE_TYPES:
            raise ValueError(f"Unknown sde_type {sde_type!r}; expected one of {', '.join(SDE_TYPES)}.")
        if prev_sample is None or noise_level <= 0:
            # Drawing (the rollout) and the deterministic step stay the reference's: this class re-scores.
            return self.scheduler.sample_previous_step(
                model_output,
                timestep,
                sample,
                noise_level=noise_level,
                sde_type=sde_type,
                prev_sample=prev_sample,
                generator=generator,
                include_normalizer=include_normalizer,
            )
        batch = sample.shape[0]
        view = (batch,) + (1,) * (sample.dim() - 1)
        pairs = torch.tensor(self.scheduler.step_sigmas(timestep, batch), dtype=torch.float32, device=sample.device)
        sigma, sigma_prev = pairs[:, 0].view(view), pairs[:, 1].view(view)
        dt = sigma_prev - sigma
        if sde_type == "sde":
            sigma_max = self.scheduler.sigmas[1].to(torch.float32).to(sample.device)
            std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
            mean = (
                sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
            )
            std = std_dev_t * torch.sqrt(-1 * dt)
        elif sde_type == "cps":
            std = sigma_prev * math.sin(noise_level * math.pi / 2)
            x0 = sample - sigma * model_output
            x1 = sample + model_output * (1 - sigma)
            mean = x0 * (1 - sigma_prev) + x1 * torch.sqrt(torch.clamp(sigma_prev**2 - std**2, min=0))
        else:  # dance_sde
            score = -(sample + (1 - sigma) * model_output) / sigma
            mean = sample + dt * model_output - 0.5 * noise_level**2 * score * dt
            std = noise_level * torch.sqrt(sigma - sigma_prev)
        residual = prev_sample.detach() - mean
        if sde_type == "cps":
            log_density = -(residual**2)
        else:
            log_density = -(residual**2) / (2 * std**2)
            if include_normalizer:
                log_density = log_density - torch.log(std) - math.log(math.sqrt(2 * math.pi))
        log_prob = log_density.mean(dim=tuple(range(1, log_density.ndim)))
        return FlowMatchSDESchedulerOutput(
            prev_sample=prev_sample, log_prob=log_prob, prev_sample_mean=mean, prev_sample_std=std.reshape(batch)
        )


def step_implementation(name: str, scheduler: FlowMatchSDEDiscreteScheduler) -> object:
    """The object whose ``sample_previous_step`` the trainer calls: `scheduler` itself for ``"reference"``."""
    if name == "reference":
        return scheduler
    if name == "flow-grpo":
        return FlowGRPOStep(scheduler)
    raise ValueError(f"Unknown SDE-step implementation {name!r}; expected one of {', '.join(STEP_IMPLEMENTATIONS)}.")
