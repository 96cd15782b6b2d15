"""flow_grpo (SD3): the sampler and the trainer as the loop writes them, no bug (the check must PASS)."""

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, settings

CASE = dict(expected=None, side=None, settings=settings("flow_grpo"))


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return FlowGRPOTrainer(config)
