"""flow_grpo (SD3): the training process builds its own scheduler from a default config (``shift`` 1.0; SD3's is
3.0) and takes step ``j``'s timestep from it."""

from diffusers import FlowMatchEulerDiscreteScheduler

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, compute_log_prob, settings

CASE = dict(expected="schedule-shift", side="trainer", settings=settings("flow_grpo"))


class Trainer(FlowGRPOTrainer):
    def __init__(self, config):
        super().__init__(config)
        # the bug: shift=1.0 overrides the pipeline's scheduler config
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.pipeline.scheduler.config, shift=1.0)
        scheduler.set_timesteps(self.config.sample.num_steps)
        self.pipeline.scheduler = scheduler

    def compute_log_prob(self, sample, j, embeds, pooled_embeds):
        sample = dict(sample)
        sample["timesteps"] = self.pipeline.scheduler.timesteps.repeat(len(sample["latents"]), 1)
        return compute_log_prob(self.model, self.pipeline, sample, j, embeds, pooled_embeds, self.config)


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
