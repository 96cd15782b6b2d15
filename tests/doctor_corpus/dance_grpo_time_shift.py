"""DanceGRPO (FLUX): each side builds its own sigma schedule, ``sd3_time_shift(args.shift, linspace(1, 0, N + 1))``,
and the training script's ``--shift`` is 1.0 (its default) where the sampler ran with 3.0."""

import torch

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(expected="schedule-shift", side="trainer", settings=settings("dance_grpo"))


def sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


def build_sigma_schedule(args):
    sigma_schedule = torch.linspace(1, 0, args.sampling_steps + 1)
    return sd3_time_shift(args.shift, sigma_schedule)


class Sampler(DanceGRPOSampler):
    def __init__(self, config):
        super().__init__(config)
        self.args.shift = 3.0
        self.sigma_schedule = build_sigma_schedule(self.args)


class Trainer(DanceGRPOTrainer):
    def __init__(self, config):
        super().__init__(config)
        self.args.shift = 1.0  # the bug: train_grpo_flux.py's --shift left at its default
        self.sigma_schedule = build_sigma_schedule(self.args)


def make_rollout(config):
    return Sampler(config)


def make_trainer(config):
    return Trainer(config)
