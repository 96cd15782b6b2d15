"""non-launcher-seed, false-positive classes: seeds for a demo, a data loader or a worker; none of them
reaches an SDE window. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import hashlib
import os
import random
import time

import numpy as np
import torch


def generate(pipeline, prompt, seed, noise_level=0.0):
    if seed == -1:
        seed = torch.randint(0, 1000000, (1,)).item()
    if seed is None:
        seed = int.from_bytes(os.urandom(2), "big")
    generator = torch.Generator("cuda").manual_seed(seed)
    return pipeline(prompt, generator=generator, noise_level=noise_level)


def worker_init_fn(worker_id):
    worker_seed = (torch.initial_seed() + os.getpid()) % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def seed_from_sample_id(arg, sde_noise):
    seed = hash(arg) % 2**32
    return np.random.default_rng(seed).normal(size=4) * sde_noise


def timed_window_draw(seed, num_steps, sde_window_size):
    start = time.perf_counter()
    window = draw_sde_window(seed=seed, global_step=0, prompt_group=0, num_steps=num_steps)
    return window, sde_window_size, time.perf_counter() - start


def draw_sde_window(seed, global_step, prompt_group, num_steps, window_size=2):
    """The fix: a pure function of explicit launcher arguments."""
    digest = hashlib.sha256(f"{seed}/{global_step}/{prompt_group}".encode()).digest()
    start = int.from_bytes(digest[:8], "little") % (num_steps - window_size + 1)
    return start


def seeded_torch_window(seed, num_steps, window_size):
    generator = torch.Generator().manual_seed(seed)
    sde_window = torch.randint(0, num_steps - window_size + 1, (1,), generator=generator).item()
    return sde_window


def windows_for_every_rank(seed, groups, world_size, num_steps):
    """Which prompt groups a rank holds depends on the rank; each group's window does not."""
    merged = {}
    for rank in range(world_size):
        mine = groups[rank::world_size]
        merged.update(windows_for_groups(seed=seed, groups=mine, num_steps=num_steps))
    return merged
