"""flow_grpo (SD3): ``config.train.cfg = False`` — the trainer re-scores without CFG what was sampled with it."""

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, settings

CASE = dict(expected="guidance-mismatch", side="trainer", settings=settings("flow_grpo"))


class Trainer(FlowGRPOTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.config.train.cfg = False  # the bug


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
