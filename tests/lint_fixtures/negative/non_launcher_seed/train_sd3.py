"""non-launcher-seed, false-positive class: per-device seeds for sampling diversity (Flow-GRPO, DanceGRPO,
DiffusionNFT trainers). The noise they draw is stored with the trajectory and read back by the trainer, and no
SDE window comes from them. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import os
import random

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


def main(config):
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    set_seed(config.seed, device_specific=True)
    rank = int(os.environ["RANK"])
    random.seed(config.seed + rank)
    np.random.seed(config.seed + rank)
    torch.manual_seed(config.seed + rank)
    generator = torch.Generator(device=accelerator.device).manual_seed(config.seed + accelerator.process_index)
    sde_window_size = config.sample.sde_window_size
    noise_level = config.sample.noise_level
    for epoch in range(config.num_epochs):
        latents = torch.randn((config.batch_size, 16, 64, 64), generator=generator, device=accelerator.device)
        sample(latents, noise_level=noise_level, sde_window_size=sde_window_size, epoch=epoch)


def seeded_window_draw(config, global_step, sde_window_range):
    """The fix: the window's generator seeded from launcher arguments in this function."""
    random.seed(config.seed + global_step)
    start = random.randint(sde_window_range[0], sde_window_range[1] - config.sde_window_size)
    return start, start + config.sde_window_size
