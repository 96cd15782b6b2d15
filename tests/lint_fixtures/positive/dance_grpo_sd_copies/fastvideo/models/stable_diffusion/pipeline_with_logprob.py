"""The DDPO pipeline as DanceGRPO copies it: latents start in the text encoder's dtype (fp16 under mixed precision), each step's output
is stored with its log-prob. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch

from .ddim_with_logprob import ddim_step_with_logprob


@torch.no_grad()
def pipeline_with_logprob(self, prompt_embeds, num_inference_steps=50, guidance_scale=7.5, eta=1.0, generator=None):
    device = self._execution_device
    self.scheduler.set_timesteps(num_inference_steps, device=device)
    timesteps = self.scheduler.timesteps
    latents = self.prepare_latents(prompt_embeds.shape[0] // 2, prompt_embeds.dtype, device, generator)
    all_latents = [latents]
    all_log_probs = []
    for t in timesteps:
        latent_model_input = torch.cat([latents] * 2)
        latent_model_input = self.scheduler.scale_model_input(latent_model_input, t)
        noise_pred = self.unet(latent_model_input, t, encoder_hidden_states=prompt_embeds, return_dict=False)[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
        latents, log_prob = ddim_step_with_logprob(self.scheduler, noise_pred, t, latents, eta=eta)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
    return image, all_latents, all_log_probs
