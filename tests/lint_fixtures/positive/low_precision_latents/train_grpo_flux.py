"""low-precision-latents, true positives: DanceGRPO / Pref-GRPO style sampling inside the training script.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import math

import torch


def flow_grpo_step(model_output, latents, eta, sigmas, index, prev_sample):
    sigma, sigma_next = sigmas[index], sigmas[index + 1]
    dt = sigma_next - sigma
    std_dev_t = eta * math.sqrt(-dt)
    prev_sample_mean = latents + dt * model_output
    pred_original_sample = latents - sigma * model_output
    if prev_sample is None:
        prev_sample = prev_sample_mean + torch.randn_like(prev_sample_mean) * std_dev_t
    log_prob = -((prev_sample.detach().float() - prev_sample_mean.float()) ** 2) / (2 * std_dev_t**2)
    return prev_sample, pred_original_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def grpo_denoise_step(transformer, latents, sigmas, index, log_probs):
    """Scores one step here and hands back the float32 sample (its log-prob goes to `log_probs`)."""
    pred = transformer(latents.to(torch.bfloat16), sigmas[index])
    prev_latents, _, log_prob = flow_grpo_step(pred.float(), latents.float(), 1.0, sigmas, index, None)
    log_probs.append(log_prob)
    return prev_latents


def run_sample_step(args, z, progress_bar, sigma_schedule, transformer, encoder_hidden_states, store_device):
    all_latents = [z]
    all_log_probs = []
    for i in progress_bar:
        with torch.autocast("cuda", torch.bfloat16):
            pred = transformer(hidden_states=z, encoder_hidden_states=encoder_hidden_states, timestep=sigma_schedule[i])[0]
        if args.grpo_step_mode == "flow":
            z, pred_original, log_prob = flow_grpo_step(pred, z.to(torch.float32), args.eta, sigma_schedule, i, None)
        else:
            z, pred_original, log_prob = flow_grpo_step(pred.float(), z.float(), 0.0, sigma_schedule, i, None)
        z = z.to(torch.bfloat16)  # expect: low-precision-latents
        all_latents.append(z.detach().to(store_device))
        all_log_probs.append(log_prob.detach().to(store_device))
    latents = pred_original
    return z, latents, torch.stack(all_latents, dim=1), torch.stack(all_log_probs, dim=1)


def sample_with_helper(transformer, latents, sigmas):
    """The sample scored in the helper (same file) comes back through its return and is stored rounded."""
    all_latents, all_log_probs = [latents], []
    for index in range(len(sigmas) - 1):
        latents = grpo_denoise_step(transformer, latents, sigmas, index, all_log_probs)
        all_latents.append(latents.bfloat16())  # expect: low-precision-latents
    return all_latents, all_log_probs
