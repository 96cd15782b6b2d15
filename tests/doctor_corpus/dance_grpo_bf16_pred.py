"""DanceGRPO (FLUX): the trainer casts the transformer's prediction to bfloat16 (the FSDP compute dtype) before
``flux_step``; the sampler steps on the float32 prediction."""

import torch

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, flux_step, settings

CASE = dict(expected="prediction-precision", side="trainer", settings=settings("dance_grpo"))


class Trainer(DanceGRPOTrainer):
    def grpo_one_step(self, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i):
        pred = self.transformer_forward(
            latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, self.args.guidance
        ).to(torch.bfloat16)  # the bug
        _, _, log_prob = flux_step(
            pred.float(),
            latents.to(torch.float32),
            self.args.eta,
            self.sigma_schedule,
            i,
            pre_latents.float(),
            True,
            True,
        )
        return log_prob


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
