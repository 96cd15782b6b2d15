"""non-launcher-seed near misses: nothing here may be reported.

Lint fixture: parsed, never imported or run.
"""

import hashlib
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from accelerate.utils import set_seed
from torch.utils.data import DistributedSampler


def device_placement():
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(local_rank)
    if local_rank == 0:
        print("main process on", device)
    return device


def data_sharding(dataset, args):
    return DistributedSampler(dataset, num_replicas=dist.get_world_size(), rank=dist.get_rank(), seed=args.seed)


def draw_sde_window(seed, global_step, prompt_group, num_steps, window_size):
    """The fix: a pure function of explicit launcher arguments."""
    digest = hashlib.sha256(f"{seed}/{global_step}/{prompt_group}".encode()).digest()
    start = int.from_bytes(digest[:8], "little") % (num_steps - window_size + 1)
    return start


def seeded_window(seed, num_steps, window_size):
    rng = random.Random(seed)
    window_start = rng.randint(0, num_steps - window_size)
    return window_start


def seeded_torch_window(seed, num_steps, window_size):
    generator = torch.Generator().manual_seed(seed)
    sde_window = torch.randint(0, num_steps - window_size + 1, (1,), generator=generator).item()
    return sde_window


def per_sample_seeds(seed, global_step, sample_indices):
    return [
        int.from_bytes(hashlib.sha256(f"{seed}/{global_step}/{i}".encode()).digest()[:4], "little")
        for i in sample_indices
    ]


def shuffle_prompts(prompts):
    random.shuffle(prompts)
    noise = torch.randn(4, 16)
    return prompts, noise


def timed_window_draw(seed, num_steps, window_size):
    start = time.perf_counter()
    window = draw_sde_window(seed, 0, 0, num_steps, window_size)
    return window, time.perf_counter() - start


def worker_init_fn(worker_id):
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def launcher_seed(config):
    set_seed(config.seed)
    set_seed(config.seed, device_specific=False)
    torch.manual_seed(config.seed + config.global_step)
