"""verl-omni (Qwen-Image): the actor keeps its LoRA weights in bfloat16 (verl-omni's ``model.lora_dtype``: every
trainable parameter cast down after ``add_adapter``), while the rollout's copy of the same adapter is float32."""

import torch

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, add_policy_lora, settings

CASE = dict(expected="forward-precision", side="trainer", settings=settings("verl_omni"))


class RolloutAdapter(QwenImageRolloutAdapter):
    def __init__(self, config):
        super().__init__(config)
        add_policy_lora(self.transformer)


class Actor(DiffusionActor):
    def __init__(self, config):
        super().__init__(config)
        add_policy_lora(self.module)
        for name, param in self.module.named_parameters():
            if ".lora_" in name:  # the bug: lora_dtype=bf16 on the actor only
                param.data = param.data.to(torch.bfloat16)


def make_rollout(config):
    return RolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
