"""low-precision-latents near misses: nothing here may be reported.

Lint fixture: parsed, never imported or run.
"""

import torch


def denoise_fixed(transformer, scheduler, latents, timesteps, dtype):
    """The fix: float32 latents throughout; the transformer gets a low-precision copy."""
    all_latents = [latents]
    all_log_probs = []
    for t in timesteps:
        noise_pred = transformer(hidden_states=latents.to(dtype), timestep=t)
        latents, log_prob = scheduler.step_with_logprob(noise_pred.float(), t, latents)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    return all_latents, all_log_probs


def forward_copy_by_name(transformer, scheduler, latents, timesteps, dtype, guidance):
    for t in timesteps:
        latent_model_input = latents.to(dtype)
        noise_pred = transformer(latent_model_input, t, guidance=guidance)
        latents = scheduler.step(noise_pred.float(), t, latents).prev_sample
    return latents


def cfg_batch(transformer, scheduler, latents, timesteps, weight_dtype):
    for t in timesteps:
        latent_model_input = torch.cat([latents] * 2).to(weight_dtype)
        noise_uncond, noise_text = transformer(latent_model_input, t).chunk(2)
        noise_pred = noise_uncond + 7.5 * (noise_text - noise_uncond)
        latents = scheduler.step(noise_pred, t, latents, return_dict=False)[0]
    return latents


def upcasts(scheduler, noise_pred, t, latents):
    prev_sample = scheduler.step(noise_pred, t, latents).prev_sample
    prev_sample = prev_sample.to(torch.float32)
    widened = prev_sample.float()
    doubled = prev_sample.to(dtype=torch.float64)
    return prev_sample, widened, doubled


def device_moves(scheduler, noise_pred, t, latents, device):
    prev_sample = scheduler.step(noise_pred, t, latents).prev_sample.to(device)
    kept = prev_sample.to(prev_sample.dtype)
    return kept.to("cpu")


def decode(vae, scheduler, noise_pred, t, latents):
    latents = scheduler.step(noise_pred, t, latents).prev_sample
    image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample
    return image


def cast_noise_prediction(transformer, latents, t, dtype):
    noise_pred = transformer(latents.to(dtype), t)
    noise_pred = noise_pred.to(dtype)
    return noise_pred.float()


def prepare_latents(shape, generator, dtype, device):
    latents = torch.randn(shape, generator=generator, device=device).to(dtype)
    return latents


def log_prob_only(scheduler, noise_pred, t, latents, prev_sample):
    log_prob = scheduler.log_prob(noise_pred.float(), t, latents, prev_sample)
    return log_prob.to(torch.bfloat16)
