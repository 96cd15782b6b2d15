"""DanceGRPO (FLUX): the trainer returns the negative log-density (a loss) from its ``grpo_one_step``."""

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(
    expected="logprob-convention",
    side="trainer",
    settings=settings("dance_grpo"),
    evidence=["negated (−log p)"],
    absent=["latent values", "sum against a mean"],
)


class Trainer(DanceGRPOTrainer):
    def grpo_one_step(self, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i):
        log_prob = super().grpo_one_step(
            latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i
        )
        return -log_prob  # the bug: the negative log-likelihood, the loss's sign


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
