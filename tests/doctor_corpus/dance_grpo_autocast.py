"""DanceGRPO (FLUX): the trainer runs its forward under bfloat16 autocast; the sampler ran in float32."""

import torch

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(expected="forward-precision", side="trainer", settings=settings("dance_grpo"))


class Trainer(DanceGRPOTrainer):
    def transformer_forward(self, *args):
        with torch.autocast("cpu", torch.bfloat16):  # the bug: the sampler's forward had no autocast
            return super().transformer_forward(*args).float()


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
