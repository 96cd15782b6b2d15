"""verl-omni (Qwen-Image): the rollout samples with ``sde_type="cps"``, the actor re-scores with ``"sde"``."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="sde-type-mismatch", side="rollout", settings=settings("verl_omni"))


class Rollout(QwenImageRolloutAdapter):
    def __init__(self, config):
        super().__init__(config)
        self.model_config.algo.sde_type = "cps"  # the bug: the rollout worker's config


def make_rollout(config):
    return Rollout(config)


def make_trainer(config):
    return DiffusionActor(config)
