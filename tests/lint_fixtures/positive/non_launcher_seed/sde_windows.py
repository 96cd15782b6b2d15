"""non-launcher-seed, true positives: other sources of an SDE window that the launcher does not decide.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import hashlib
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist


def window_per_request(request_id, num_steps, sde_window_size):
    rng = random.Random(hash(request_id))  # expect: non-launcher-seed
    start = rng.randint(0, num_steps - sde_window_size)
    return start, sde_window_size


def window_from_torch_global(num_steps, window_size, noise_level):
    sde_window = torch.randint(0, num_steps - window_size + 1, (1,)).item()  # expect: non-launcher-seed
    return sde_window, noise_level


def window_from_rank_generator(args, device, num_steps):
    generator = torch.Generator(device=device).manual_seed(args.seed + dist.get_rank())  # expect: non-launcher-seed
    window_start = torch.randint(0, num_steps - args.sde_window_size, (1,), generator=generator, device=device).item()
    return window_start


def window_from_numpy(num_steps, sde_window_size):
    window_start = np.random.randint(0, num_steps - sde_window_size)  # expect: non-launcher-seed
    return window_start


def window_from_clock(num_steps, sde_window_size):
    window_start = draw_sde_window(seed=int(time.time()), num_steps=num_steps)  # expect: non-launcher-seed
    return window_start, sde_window_size


class RolloutWorker:
    def __init__(self, config):
        self.config = config

    def sde_window_for(self, batch_size):
        return [(self.config.seed + self.rank * batch_size) % self.config.num_steps for _ in range(batch_size)]  # expect: non-launcher-seed


def window_per_request_digest(req, low, high, sde_window_size):
    """A digest is reproducible, but of one request's id: the rollouts of a prompt group get other windows."""
    digest = hashlib.sha256(str(req.request_id).encode()).digest()  # expect: non-launcher-seed
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    begin = rng.randint(low, high - sde_window_size)
    return begin, begin + sde_window_size


def window_from_env_rank(num_steps, sde_window_size):
    rank = int(os.getenv("RANK", "0"))  # expect: non-launcher-seed
    rng = random.Random(rank)
    sde_window_start = rng.randint(0, num_steps - sde_window_size)
    return sde_window_start
