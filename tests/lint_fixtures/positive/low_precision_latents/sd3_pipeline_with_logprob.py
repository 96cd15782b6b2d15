"""low-precision-latents, true positives: Flow-GRPO style rollout loops. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch

from .flow_match_sde_scheduler import sde_step_with_logprob


@torch.no_grad()
def pipeline_with_logprob(self, prompt_embeds, pooled_prompt_embeds, timesteps, latents, noise_level=0.7):
    """The float32 sample is stored, the rounded one is carried into the next step's log-prob."""
    all_latents = [latents]
    all_log_probs = []
    for i, t in enumerate(timesteps):
        latent_model_input = torch.cat([latents] * 2) if self.do_classifier_free_guidance else latents
        noise_pred = self.transformer(
            hidden_states=latent_model_input,
            timestep=t.expand(latent_model_input.shape[0]),
            encoder_hidden_states=prompt_embeds,
            pooled_projections=pooled_prompt_embeds,
            return_dict=False,
        )[0]
        noise_pred = noise_pred.to(prompt_embeds.dtype)
        if self.do_classifier_free_guidance:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + self.guidance_scale * (noise_pred_text - noise_pred_uncond)
        latents_dtype = latents.dtype
        latents, log_prob, prev_latents_mean, std_dev_t = sde_step_with_logprob(
            self.scheduler, noise_pred.float(), t.unsqueeze(0), latents.float(), noise_level=noise_level
        )
        all_latents.append(latents)
        all_log_probs.append(log_prob)
        if latents.dtype != latents_dtype:
            latents = latents.to(latents_dtype)  # expect: low-precision-latents
    image = self.vae.decode(latents.to(self.vae.dtype) / self.vae.config.scaling_factor, return_dict=False)[0]
    return image, all_latents, all_log_probs


@torch.no_grad()
def pipeline_with_output_object(self, prompt_embeds, timesteps, latents, noise_level=0.7):
    """The log-prob is read from the step's output object; the rounded sample is stored beside it."""
    all_latents, all_log_probs = [latents], []
    for t in timesteps:
        noise_pred = self.transformer(hidden_states=latents.to(prompt_embeds.dtype), timestep=t)[0]
        output = self.scheduler.step(noise_pred.float(), t, latents.float(), noise_level=noise_level)
        latents = output.prev_sample.to(prompt_embeds.dtype)  # expect: low-precision-latents
        all_latents.append(latents)
        all_log_probs.append(output.log_prob)
    return all_latents, all_log_probs


@torch.no_grad()
def pipeline_rounding_the_step_input(self, prompt_embeds, timesteps, latents, noise_level=0.7):
    """Only the step's input is rounded; the stored latents stay float32 (the next log-prob scores another input)."""
    all_latents, all_log_probs = [latents], []
    for t in timesteps:
        model_input = latents.to(torch.bfloat16)  # expect: low-precision-latents
        noise_pred = self.transformer(hidden_states=model_input, timestep=t)[0]
        latents, log_prob, _, _ = sde_step_with_logprob(self.scheduler, noise_pred.float(), t, model_input)
        all_latents.append(latents)
        all_log_probs.append(log_prob)
    return all_latents, all_log_probs
