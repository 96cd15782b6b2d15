"""DanceGRPO (FLUX): the sampler and the trainer as the loop writes them, storing whole-number timesteps
(int(sigma * 1000)), no bug (the check must PASS)."""

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(expected=None, side=None, settings=settings("dance_grpo"))


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return DanceGRPOTrainer(config)
