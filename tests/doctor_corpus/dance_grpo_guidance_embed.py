"""DanceGRPO (FLUX-dev): the trainer feeds the embedded guidance 1.0 where the sampler fed 3.5."""

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(expected="guidance-mismatch", side="trainer", settings=settings("dance_grpo"))


class Trainer(DanceGRPOTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.args.guidance = 1.0  # the bug: the trainer's launcher left --guidance at its default


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
