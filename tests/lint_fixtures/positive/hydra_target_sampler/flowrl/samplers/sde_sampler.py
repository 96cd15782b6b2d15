"""The SDE sampler the config names (`_target_: flowrl.samplers.sde_sampler.SDESampler`): it keeps the step's
output in the transformer's dtype beside a float32 log-prob (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import math

import torch


def flow_sde_step_with_logprob(model_output, sigma, sigma_next, sample, noise_level):
    dt = sigma_next - sigma
    std_dev_t = noise_level * math.sqrt(sigma / (1 - sigma))
    prev_sample_mean = sample + model_output * dt
    prev_sample = prev_sample_mean + std_dev_t * math.sqrt(-dt) * torch.randn_like(model_output)
    log_prob = -((prev_sample.detach().float() - prev_sample_mean.float()) ** 2) / (2 * std_dev_t**2 * -dt)
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample.to(sample.dtype), log_prob  # expect: low-precision-latents


class SDESampler:
    def __init__(self, noise_level, num_steps):
        self.noise_level = noise_level
        self.num_steps = num_steps

    def sample(self, batch):
        latents, sigmas = batch["latents"], batch["sigmas"]
        all_latents, all_log_probs = [latents], []
        for i in range(self.num_steps):
            noise_pred = batch["transformer"](latents, sigmas[i])
            latents, log_prob = flow_sde_step_with_logprob(noise_pred, sigmas[i], sigmas[i + 1], latents, self.noise_level)
            all_latents.append(latents)
            all_log_probs.append(log_prob)
        return {"latents": torch.stack(all_latents, dim=1), "log_probs": torch.stack(all_log_probs, dim=1)}
