"""The DiffusionNFT-style pipeline: passes the sampler's log-probs on to its caller, reads none of them.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch

from .solver import run_sampling


@torch.no_grad()
def pipeline_with_logprob(self, prompt_embeds, pooled_prompt_embeds, sigmas, noise_level=0.7):
    latents = self.prepare_latents(prompt_embeds.shape[0], prompt_embeds.dtype)

    def v_pred_fn(z, sigma):
        timestep = (sigma * 1000).expand(z.shape[0])
        return self.transformer(z, timestep, prompt_embeds, pooled_prompt_embeds, return_dict=False)[0]

    latents, all_latents, all_log_probs = run_sampling(v_pred_fn, latents, sigmas, noise_level)
    image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
    return image, all_latents, all_log_probs
