"""verl-omni (Qwen-Image), true CFG 4.0: the actor casts each noise prediction to bfloat16 (the engine's dtype)
before true CFG and the step; the rollout keeps them float32."""

import torch

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(expected="prediction-precision", side="trainer", settings=settings("verl_omni", true_cfg_scale=4.0))


class Actor(DiffusionActor):
    def forward(self, model_inputs):
        return super().forward(model_inputs).to(torch.bfloat16)  # the bug


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
