"""flow_grpo (SD3): the training loop re-scores with ``noise_level`` 0.8 while the sampler drew at 0.7 (a config
field overridden for training only)."""

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, settings

CASE = dict(expected="noise-level-mismatch", side="trainer", settings=settings("flow_grpo"))


class Trainer(FlowGRPOTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.config.sample.noise_level = 0.8  # the bug


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
