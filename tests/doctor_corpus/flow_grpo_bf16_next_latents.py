"""flow_grpo (SD3): the sampler stores ``next_latents`` rounded to bfloat16 after it computed their log-probs."""

import torch

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, settings

CASE = dict(expected="bf16-latents", side="rollout", settings=settings("flow_grpo"))


class Sampler(FlowGRPOSampler):
    def __call__(self, request):
        out = super().__call__(request)
        samples = out.batch
        # the bug: the stored trajectory goes through the model's dtype (to save memory) after scoring
        stored = torch.cat([samples["latents"][:, :1], samples["next_latents"]], dim=1).bfloat16().float()
        samples["latents"], samples["next_latents"] = stored[:, :-1], stored[:, 1:]
        return out


def make_rollout(config):
    return Sampler(config)


def make_trainer(config):
    return FlowGRPOTrainer(config)
