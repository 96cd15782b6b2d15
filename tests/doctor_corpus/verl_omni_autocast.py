"""verl-omni (Qwen-Image): the actor runs its forward under bfloat16 autocast; the rollout ran in float32."""

import torch

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="forward-precision", side="trainer", settings=settings("verl_omni"))


class Actor(DiffusionActor):
    def forward(self, model_inputs):
        with torch.autocast("cpu", torch.bfloat16):  # the bug: the rollout's forward had no autocast
            return super().forward(model_inputs).float()


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
