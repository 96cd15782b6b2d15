"""DanceGRPO (FLUX): the trainer's log-density drops the Gaussian normaliser ``-log(std) - log(sqrt(2 pi))``."""

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(expected="logprob-convention", side="trainer", settings=settings("dance_grpo"))


class Trainer(DanceGRPOTrainer):
    def grpo_one_step(self, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i):
        prev_sample_mean, std_dev_t = self.transition(
            latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i
        )
        log_prob = -((pre_latents.float() - prev_sample_mean) ** 2) / (2 * std_dev_t**2)  # the bug: no normaliser
        return log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
