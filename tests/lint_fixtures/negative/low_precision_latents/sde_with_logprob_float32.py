"""An SDE step that makes its input float32 first: its cast back to `sample.dtype` is to float32 and rounds
nothing (no mixed-precision setting in sight). Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


def sde_step_with_logprob(scheduler, model_output, sigma, sigma_next, sample, noise_level=0.7):
    sample = sample.float()
    model_output = model_output.float()
    std_dev_t = noise_level * (sigma / (1 - sigma)) ** 0.5
    prev_sample_mean = sample + (sigma_next - sigma) * model_output
    prev_sample = prev_sample_mean + std_dev_t * torch.randn_like(sample)
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * std_dev_t**2)
    return prev_sample.to(sample.dtype), log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
