"""verl-omni (Qwen-Image), true CFG 4.0: the actor combines the two predictions without the norm rescale."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="guidance-mismatch", side="trainer", settings=settings("verl_omni", true_cfg_scale=4.0))


class Actor(DiffusionActor):
    def forward_and_sample_previous_step(self, model_inputs, negative_model_inputs, scheduler_inputs, step):
        latents, timesteps = scheduler_inputs["all_latents"], scheduler_inputs["all_timesteps"]
        cond, uncond = self.forward(model_inputs), self.forward(negative_model_inputs)
        noise_pred = uncond + self.model_config.pipeline.true_cfg_scale * (cond - uncond)  # the bug: no rescale
        return self.scheduler.sample_previous_step(
            noise_pred.float(),
            timesteps[:, step],
            latents[:, step].float(),
            noise_level=self.model_config.algo.noise_level,
            sde_type=self.model_config.algo.sde_type,
            prev_sample=latents[:, step + 1].float(),
        ).log_prob


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
