"""low-precision-latents, true positive: an SDE scheduler step that scores the float32 sample and returns it
rounded to the model's dtype (verl-omni's scheduler before 5120aac9). Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from dataclasses import dataclass

import torch


@dataclass
class FlowMatchSDESchedulerOutput:
    prev_sample: torch.FloatTensor
    log_prob: torch.FloatTensor | None
    prev_sample_mean: torch.FloatTensor
    std_dev_t: torch.FloatTensor


class FlowMatchSDEScheduler:
    def sample_previous_step(self, sample, model_output, noise_level, generator=None, prev_sample=None):
        sigma, sigma_prev = self.sigmas[self.step_index], self.sigmas[self.step_index + 1]
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, self.sigma_max, sigma))) * noise_level
        prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * (sigma_prev - sigma)) + model_output * (
            1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)
        ) * (sigma_prev - sigma)
        if prev_sample is None:
            noise = torch.randn(sample.shape, generator=generator, device=sample.device, dtype=sample.dtype)
            prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(sigma - sigma_prev) * noise
        log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * (std_dev_t * torch.sqrt(sigma - sigma_prev)) ** 2)
        return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim))), prev_sample_mean, std_dev_t

    def step(self, model_output, timestep, sample, generator=None, noise_level=0.7, prev_sample=None, return_dict=True):
        if self.step_index is None:
            self._init_step_index(timestep)
        # Upcast to avoid precision issues when computing prev_sample
        sample = sample.to(torch.float32)
        prev_sample, log_prob, prev_sample_mean, std_dev_t = self.sample_previous_step(
            sample=sample,
            model_output=model_output,
            noise_level=noise_level,
            generator=generator,
            prev_sample=prev_sample,
        )
        self._step_index += 1
        # Cast sample back to model compatible dtype
        prev_sample = prev_sample.to(model_output.dtype)  # expect: low-precision-latents
        if not return_dict:
            return (prev_sample, log_prob, prev_sample_mean, std_dev_t)
        return FlowMatchSDESchedulerOutput(
            prev_sample=prev_sample, log_prob=log_prob, prev_sample_mean=prev_sample_mean, std_dev_t=std_dev_t
        )


def sde_step_with_logprob(self, model_output, timestep, sample, noise_level=0.7, prev_sample=None, generator=None):
    """A functional step, as Flow-GRPO's `diffusers_patch` writes it: the log-prob is computed in this function."""
    model_output = model_output.float()
    sample = sample.float()
    step_index = [self.index_for_timestep(t) for t in timestep]
    sigma = self.sigmas[step_index].view(-1, 1, 1, 1)
    sigma_prev = self.sigmas[[i + 1 for i in step_index]].view(-1, 1, 1, 1)
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - sigma)) * noise_level
    prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if prev_sample is None:
        variance_noise = torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample.half(), log_prob, prev_sample_mean, std_dev_t  # expect: low-precision-latents
