"""Shaped like Flow-GRPO's SD3 sampling loop (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import torch

from .sd3_sde_with_logprob import sde_step_with_logprob


@torch.no_grad()
def pipeline_with_logprob(self, prompt_embeds, pooled_prompt_embeds, num_inference_steps=10, guidance_scale=4.5,
                          noise_level=0.7, generator=None):
    batch_size = prompt_embeds.shape[0]
    latents = self.prepare_latents(batch_size, prompt_embeds.dtype, generator)
    timesteps = self.retrieve_timesteps(num_inference_steps)
    all_latents = [latents]
    all_log_probs = []
    for i, t in enumerate(timesteps):
        latent_model_input = torch.cat([latents] * 2)
        timestep = t.expand(latent_model_input.shape[0])
        noise_pred = self.transformer(
            hidden_states=latent_model_input,
            timestep=timestep,
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled_prompt_embeds,
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)

        latents_dtype = latents.dtype
        latents, log_prob, prev_latents_mean, std_dev_t = sde_step_with_logprob(
            self.scheduler, noise_pred.float(), t.unsqueeze(0), latents.float(), noise_level=noise_level
        )
        if latents.dtype != latents_dtype:
            latents = latents.to(latents_dtype)  # expect: low-precision-latents
        all_latents.append(latents)
        all_log_probs.append(log_prob)

    image = self.vae.decode(latents.to(self.vae.dtype) / self.vae.config.scaling_factor, return_dict=False)[0]
    return image, all_latents, all_log_probs
