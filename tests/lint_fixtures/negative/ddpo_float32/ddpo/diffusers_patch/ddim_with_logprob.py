"""A DDIM step whose cast back to the input's dtype rounds nothing: the config trains in float32.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


def ddim_step_with_logprob(scheduler, model_output, timestep, sample, eta=1.0, prev_sample=None):
    std_dev_t = eta * scheduler.variance(timestep) ** 0.5
    prev_sample_mean = scheduler.mean(model_output, timestep, sample)
    if prev_sample is None:
        prev_sample = prev_sample_mean + std_dev_t * torch.randn_like(prev_sample_mean)
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * (std_dev_t**2)) - torch.log(std_dev_t)
    return prev_sample.type(sample.dtype), log_prob.mean(dim=tuple(range(1, log_prob.ndim)))

