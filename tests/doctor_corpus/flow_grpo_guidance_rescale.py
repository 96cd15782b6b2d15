"""flow_grpo (SD3): the trainer applies diffusers' ``rescale_noise_cfg`` (``guidance_rescale=0.7``) after CFG; the
sampler does not."""

import torch
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, sde_step_with_logprob, settings

CASE = dict(expected="guidance-mismatch", side="trainer", settings=settings("flow_grpo"))


class Trainer(FlowGRPOTrainer):
    guidance_rescale = 0.7  # the bug: a setting of the inference pipeline copied into the training config

    def compute_log_prob(self, sample, j, embeds, pooled_embeds):
        noise_pred = self.model(
            hidden_states=torch.cat([sample["latents"][:, j]] * 2),
            timestep=torch.cat([sample["timesteps"][:, j]] * 2),
            encoder_hidden_states=embeds,
            pooled_projections=pooled_embeds,
            return_dict=False,
        )[0]
        noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
        noise_pred = noise_pred_uncond + self.config.sample.guidance_scale * (noise_pred_text - noise_pred_uncond)
        noise_pred = rescale_noise_cfg(noise_pred, noise_pred_text, guidance_rescale=self.guidance_rescale)
        _, log_prob, _, _ = sde_step_with_logprob(
            self.pipeline.scheduler,
            noise_pred.float(),
            sample["timesteps"][:, j],
            sample["latents"][:, j].float(),
            prev_sample=sample["next_latents"][:, j].float(),
            noise_level=self.config.sample.noise_level,
        )
        return log_prob


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
