"""flow_grpo (SD3): both sides hold the same LoRA policy, but the sampler rebuilt its LoraConfig with lora_alpha = r
(scale 1) where the trainer's has lora_alpha = 2r (scale 2)."""

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, add_policy_lora, settings

CASE = dict(expected="adapter-scale", side="rollout", settings=settings("flow_grpo"))


class Sampler(FlowGRPOSampler):
    def __init__(self, config):
        super().__init__(config)
        add_policy_lora(self.pipeline.transformer, lora_alpha=8)  # the bug: the trainer's lora_alpha is 16


class Trainer(FlowGRPOTrainer):
    def __init__(self, config):
        super().__init__(config)
        add_policy_lora(self.pipeline.transformer, lora_alpha=16)


def make_rollout(config):
    return Sampler(config)


def make_trainer(config):
    return Trainer(config)
