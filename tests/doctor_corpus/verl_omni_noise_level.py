"""verl-omni (Qwen-Image): the actor's ``algo.noise_level`` is 0.8 while the rollout sampled with 0.7."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="noise-level-mismatch", side="trainer", settings=settings("verl_omni"))


class Actor(DiffusionActor):
    def __init__(self, config):
        super().__init__(config)
        self.model_config.algo.noise_level = 0.8  # the bug: the actor's config was edited, the rollout's not


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
