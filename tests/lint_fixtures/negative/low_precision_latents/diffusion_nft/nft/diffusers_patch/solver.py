"""A DiffusionNFT-style sampler: it rounds the carried latents to the model dtype beside float32 log-probs —
the low-precision-latents pattern — but the pipeline only passes the log-probs on and the trainer discards them
(negative-aware fine-tuning needs none), so nothing disagrees. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


def flow_step(model_output, sigmas, index, z, noise_level):
    sigma, sigma_prev = sigmas[index], sigmas[index + 1]
    std_dev_t = noise_level * (sigma / (1 - sigma)) ** 0.5
    prev_sample_mean = z + (sigma_prev - sigma) * model_output
    prev_sample = prev_sample_mean + std_dev_t * torch.randn_like(z)
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * std_dev_t**2)
    return prev_sample, prev_sample_mean, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def run_sampling(v_pred_fn, z, sigmas, noise_level=0.7):
    dtype = z.dtype
    all_latents = [z]
    all_log_probs = []
    for i, sigma in enumerate(sigmas[:-1]):
        pred = v_pred_fn(z.to(dtype), sigma)
        z, pred_original, log_prob = flow_step(pred.float(), sigmas, i, z.float(), noise_level)
        z = z.to(dtype)
        all_latents.append(z)
        all_log_probs.append(log_prob)
    latents = z.to(dtype)
    return latents, all_latents, all_log_probs


def flow_sde_step(model_output, sigmas, index, sample, noise_level=0.7):
    """One step that hands back its sample in the model dtype beside the float32 log-prob."""
    dtype = model_output.dtype
    z = sample.float()
    sigma, sigma_prev = sigmas[index], sigmas[index + 1]
    std_dev_t = noise_level * (sigma / (1 - sigma)) ** 0.5
    prev_sample_mean = z + (sigma_prev - sigma) * model_output.float()
    prev_sample = prev_sample_mean + std_dev_t * torch.randn_like(z)
    log_prob = -((prev_sample.detach() - prev_sample_mean) ** 2) / (2 * std_dev_t**2)
    return prev_sample.to(dtype), log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
