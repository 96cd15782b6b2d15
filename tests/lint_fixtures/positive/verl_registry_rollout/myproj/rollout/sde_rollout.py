"""The SDE rollout the registry loads by name: no file imports it, but `rollout: sde` runs it. Its step
rounds `prev_sample` to the model's dtype beside a float32 log-prob (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import math

import torch


def sde_step_with_logprob(scheduler, model_output, timestep_index, sample, noise_level=0.7, prev_sample=None):
    sigma = scheduler.sigmas[timestep_index]
    sigma_prev = scheduler.sigmas[timestep_index + 1]
    dt = sigma_prev - sigma
    std_dev_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, scheduler.sigmas[1], sigma)))
    prev_sample_mean = sample * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (
        1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)
    ) * dt
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * torch.randn_like(model_output)
    log_prob = (
        -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi)))
    )
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample.type(sample.dtype), log_prob  # expect: low-precision-latents


class Rollout:
    def __init__(self, config):
        self.config = config

    def generate_sequences(self, prompts):
        latents = self.config.initial_latents(prompts)
        all_latents, all_log_probs = [latents], []
        for index in range(self.config.num_steps):
            noise_pred = self.config.transformer(latents, index, prompts)
            latents, log_prob = sde_step_with_logprob(self.config.scheduler, noise_pred, index, latents)
            all_latents.append(latents)
            all_log_probs.append(log_prob)
        return {"latents": torch.stack(all_latents, dim=1), "old_log_probs": torch.stack(all_log_probs, dim=1)}
