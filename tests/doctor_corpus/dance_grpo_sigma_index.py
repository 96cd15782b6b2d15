"""DanceGRPO (FLUX): the trainer's ``flux_step`` takes sigma ``index + 1`` (its timestep to the model is right)."""

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, flux_step, settings

CASE = dict(expected="step-index", side="trainer", settings=settings("dance_grpo"))


class Trainer(DanceGRPOTrainer):
    def grpo_one_step(self, latents, pre_latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, i):
        pred = self.transformer_forward(
            latents, encoder_hidden_states, pooled_prompt_embeds, image_ids, timesteps, self.args.guidance
        )
        # the bug: perms[i][_] + 1, a 1-based step index into the 0-based sigma schedule
        _, _, log_prob = flux_step(
            pred, latents.float(), self.args.eta, self.sigma_schedule, i + 1, pre_latents.float(), True, True
        )
        return log_prob


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
