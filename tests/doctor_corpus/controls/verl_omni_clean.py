"""verl-omni (Qwen-Image): the rollout adapter and the actor as the loop writes them, no bug (the check must PASS)."""

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected=None, side=None, settings=settings("verl_omni"))


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return DiffusionActor(config)
