"""A DiffusionNFT-style FLUX pipeline: collects each step's log-prob in a list and returns it; the trainer
discards it. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch

from .solver import flow_sde_step


@torch.no_grad()
def flux_pipeline_with_logprob(self, prompt_embeds, sigmas, noise_level=0.7):
    latents = self.prepare_latents(prompt_embeds.shape[0], prompt_embeds.dtype)
    all_latents = [latents]
    all_log_probs = []
    for i, sigma in enumerate(sigmas[:-1]):
        noise_pred = self.transformer(latents, sigma.expand(latents.shape[0]), prompt_embeds, return_dict=False)[0]
        latents, log_prob = flow_sde_step(noise_pred, sigmas, i, latents, noise_level)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
    return image, all_latents, all_log_probs
