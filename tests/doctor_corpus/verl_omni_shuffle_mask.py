"""verl-omni (Qwen-Image): the actor shuffles its micro-batch rows, permuting ``prompt_embeds`` but not
``prompt_embeds_mask``."""

import torch

from doctor_corpus.loops import DiffusionActor, QwenImageRolloutAdapter, settings

CASE = dict(
    expected="misaligned-batch",
    side="trainer",
    settings=settings("verl_omni"),
    evidence=[
        "the trainer's text mask is exactly the rollout's of another sample",
        "`prompt_embeds_mask` was left out",
    ],
    absent=["text conditioning is exactly"],
)


class Actor(DiffusionActor):
    def compute_log_prob(self, data, micro_batch_size):
        n = data["all_timesteps"].shape[0]
        perm = torch.roll(torch.arange(n), 1)  # a shuffle (deterministic here)
        shuffled = {k: (v if k == "prompt_embeds_mask" else v[perm]) for k, v in data.items()}  # the bug
        return super().compute_log_prob(shuffled, micro_batch_size)[torch.argsort(perm)]


def make_rollout(config):
    return QwenImageRolloutAdapter(config)


def make_trainer(config):
    return Actor(config)
