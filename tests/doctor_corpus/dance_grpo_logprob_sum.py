"""DanceGRPO (FLUX): the trainer's ``flux_step`` sums the log-density over the latent instead of averaging it."""

import math

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(expected="logprob-reduction", side="trainer", settings=settings("dance_grpo"))


class Trainer(DanceGRPOTrainer):
    def grpo_one_step(self, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i):
        prev_sample_mean, std_dev_t = self.transition(
            latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i
        )
        log_prob = (
            -((pre_latents.float() - prev_sample_mean) ** 2) / (2 * std_dev_t**2)
            - math.log(std_dev_t)
            - math.log(math.sqrt(2 * math.pi))
        )
        return log_prob.sum(dim=tuple(range(1, log_prob.ndim)))  # the bug: sum, not mean


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
