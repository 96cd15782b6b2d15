"""An advantage-weighted-matching style pipeline: it still steps with the log-prob SDE step and carries the
rounded latents on, but keeps the log-probs to itself (it returns the image and the latents; the trainer's
matching loss needs no rollout log-prob). Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


@torch.no_grad()
def pipeline_with_logprob(self, prompt_embeds, pooled_prompt_embeds, timesteps, noise_level=0.7):
    latents = self.prepare_latents(prompt_embeds.shape[0], prompt_embeds.dtype)
    latents_dtype = latents.dtype
    all_latents = [latents]
    all_log_probs = []
    for t in timesteps:
        noise_pred = self.transformer(latents, t.expand(latents.shape[0]), prompt_embeds, pooled_prompt_embeds)[0]
        latents, log_prob, prev_latents_mean, std_dev_t = self.sde_step_with_logprob(
            noise_pred.float(), t, latents.float(), noise_level=noise_level
        )
        latents = latents.to(latents_dtype)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    image = self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]
    return image, all_latents
