"""flow_grpo (SD3): the trainer shuffles ``samples`` key by key with ``perm`` but forgets ``next_latents``."""

import torch

from doctor_corpus.loops import FlowGRPOSampler, FlowGRPOTrainer, settings

CASE = dict(
    expected="misaligned-batch",
    side="trainer",
    settings=settings("flow_grpo"),
    # What the replay matched, and no claim it did not measure.
    evidence=[
        "`latents` row 3 with `next_latents` row 0",
        "`next_latents` was left out of the permutation the other keys took",
    ],
    absent=["the trainer's log-probs are reproduced", "scored a sample other than"],
)


class Trainer(FlowGRPOTrainer):
    def __call__(self, samples, *, micro_batch_size):
        total_batch_size = samples["timesteps"].shape[0]
        perm = torch.roll(torch.arange(total_batch_size), 1)  # a shuffle (deterministic here)
        keys = [
            "prompt_embeds",
            "pooled_prompt_embeds",
            "timesteps",
            "latents",
            "log_probs",
        ]  # the bug: no next_latents
        shuffled = {**samples, **{k: samples[k][perm] for k in keys}}
        out = super().__call__(shuffled, micro_batch_size=micro_batch_size)
        return out[torch.argsort(perm)]  # back to sample order


def make_rollout(config):
    return FlowGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
