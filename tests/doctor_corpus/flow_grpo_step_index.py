"""flow_grpo (SD3): the trainer scores step ``j`` with step ``j - 1``'s timestep (an off-by-one in the index)."""

import torch

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, compute_log_prob, settings

CASE = dict(expected="step-index", side="trainer", settings=settings("flow_grpo"))


class Trainer(FlowGRPOTrainer):
    def compute_log_prob(self, sample, j, embeds, pooled_embeds):
        shifted = dict(sample)
        previous = torch.cat([sample["timesteps"][:, :1], sample["timesteps"][:, :-1]], dim=1)
        shifted["timesteps"] = previous  # the bug: timesteps[:, j - 1] (step 0 keeps its own)
        return compute_log_prob(self.model, self.pipeline, shifted, j, embeds, pooled_embeds, self.config)


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
