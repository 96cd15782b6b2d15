"""verl-omni (Qwen-Image): the rollout samples with true CFG 4.0, the actor's model config keeps the default
``true_cfg_scale`` 1.0, so it re-scores with one forward per step."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="guidance-mismatch", side="trainer", settings=settings("verl_omni", true_cfg_scale=4.0))


class Actor(DiffusionActor):
    def __init__(self, config):
        super().__init__(config)
        self.model_config.pipeline.true_cfg_scale = 1.0  # the bug


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
