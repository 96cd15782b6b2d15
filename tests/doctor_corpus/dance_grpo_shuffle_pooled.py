"""DanceGRPO (FLUX): the trainer shuffles ``samples`` with ``perm`` before ``train_one_step`` but forgets
``pooled_prompt_embeds``."""

import torch

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(
    expected="misaligned-batch",
    side="trainer",
    settings=settings("dance_grpo"),
    evidence=["the trainer's pooled text is exactly the rollout's of another sample", "`pooled_prompt_embeds`"],
    absent=["text mask", "next latents"],
)


class Trainer(DanceGRPOTrainer):
    def __call__(self, samples, *, micro_batch_size):
        batch_size = samples["timesteps"].shape[0]
        perm = torch.roll(torch.arange(batch_size), 1)  # a shuffle (deterministic here)
        keys = ["timesteps", "latents", "next_latents", "log_probs", "encoder_hidden_states"]  # the bug: no pooled
        shuffled = {**samples, **{k: samples[k][perm] for k in keys}}
        return super().__call__(shuffled, micro_batch_size=micro_batch_size)[torch.argsort(perm)]


def make_rollout(config):
    return DanceGRPOSampler(config)


def make_trainer(config):
    return Trainer(config)
