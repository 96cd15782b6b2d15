"""flow_grpo (SD3): the trainer holds the policy one optimizer step ahead of the sampler's copy."""

import torch

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, settings

CASE = dict(expected="different-weights", side="trainer", settings=settings("flow_grpo"))


class Trainer(FlowGRPOTrainer):
    def __init__(self, config):
        super().__init__(config)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():  # the bug: an update the sampler never received
            weight = self.model.proj_out.weight
            weight.add_(1e-3 * torch.randn(weight.shape, generator=generator))


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
