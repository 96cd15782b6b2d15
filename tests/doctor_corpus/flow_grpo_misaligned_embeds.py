"""flow_grpo (SD3): the trainer shuffles the samples (``perm``) but takes ``prompt_embeds`` from before the shuffle."""

import torch

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, settings

CASE = dict(
    expected="misaligned-batch",
    side="trainer",
    settings=settings("flow_grpo"),
    evidence=["`prompt_embeds` rows follow the batch's order while its `latents` rows are permuted"],
    absent=["next latents"],
)


class Trainer(FlowGRPOTrainer):
    def __call__(self, samples, *, micro_batch_size):
        n = samples["timesteps"].shape[0]
        perm = torch.roll(torch.arange(n), 1)  # a shuffle (deterministic here)
        shuffled = {k: v[perm] for k, v in samples.items() if k not in ("prompt_embeds", "pooled_prompt_embeds")}
        # the bug: the embeddings were added to the dict after the shuffle
        shuffled["prompt_embeds"], shuffled["pooled_prompt_embeds"] = (
            samples["prompt_embeds"],
            samples["pooled_prompt_embeds"],
        )
        out = super().__call__(shuffled, micro_batch_size=micro_batch_size)
        return out[torch.argsort(perm)]  # back to sample order


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
