"""flow_grpo (SD3): the training config's CFG scale is 3.5 while the sampler ran with 4.5."""

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, settings

CASE = dict(expected="guidance-mismatch", side="trainer", settings=settings("flow_grpo"))


class Trainer(FlowGRPOTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.config.sample.guidance_scale = 3.5  # the bug: train.py reads another guidance_scale


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
