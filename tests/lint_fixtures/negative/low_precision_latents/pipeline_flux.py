"""low-precision-latents, false-positive class: inference loops. diffusers' pipelines restore the latents'
dtype after each step (an MPS workaround); with no log-prob computed or stored there is no trainer to disagree.

Lint fixture: parsed, never imported or run.
"""

import torch


class FluxPipeline:
    @torch.no_grad()
    def __call__(self, prompt_embeds, pooled_prompt_embeds, latents, timesteps, guidance, latent_image_ids, text_ids):
        with self.progress_bar(total=len(timesteps)) as progress_bar:
            for i, t in enumerate(timesteps):
                timestep = t.expand(latents.shape[0]).to(latents.dtype)
                noise_pred = self.transformer(
                    hidden_states=latents,
                    timestep=timestep / 1000,
                    guidance=guidance,
                    pooled_projections=pooled_prompt_embeds,
                    encoder_hidden_states=prompt_embeds,
                    txt_ids=text_ids,
                    img_ids=latent_image_ids,
                    return_dict=False,
                )[0]
                # compute the previous noisy sample x_t -> x_t-1
                latents_dtype = latents.dtype
                latents = self.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
                if latents.dtype != latents_dtype:
                    if torch.backends.mps.is_available():
                        # some platforms (eg. apple mps) misbehave due to a pytorch bug
                        latents = latents.to(latents_dtype)
                progress_bar.update()
        latents = self._unpack_latents(latents, self.height, self.width, self.vae_scale_factor)
        latents = (latents / self.vae.config.scaling_factor) + self.vae.config.shift_factor
        return self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]


def log_validation(pipeline, transformer, prompt_embeds, latents, timesteps, weight_dtype):
    """A trainer's validation sampling: images for a report, nothing scored."""
    for t in timesteps:
        noise_pred = transformer(latents.to(weight_dtype), t, prompt_embeds)
        latents = pipeline.scheduler.step(noise_pred, t, latents).prev_sample.to(weight_dtype)
    return pipeline.vae.decode(latents / pipeline.vae.config.scaling_factor).sample
