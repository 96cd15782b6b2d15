"""non-launcher-seed: every line marked `# expect: <rule>` must be reported (and nothing else).

Lint fixture: parsed, never imported or run.
"""

import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from accelerate.utils import set_seed


def window_from_local_rank(num_steps, window_size):
    local_rank = int(os.environ["LOCAL_RANK"])
    sde_window_start = local_rank % (num_steps - window_size + 1)  # expect: non-launcher-seed
    return sde_window_start


def noise_generator_per_rank(args, device):
    seed = args.seed + dist.get_rank()  # expect: non-launcher-seed
    return torch.Generator(device=device).manual_seed(seed)


def seed_per_process(accelerator, args):
    torch.manual_seed(args.seed + accelerator.process_index)  # expect: non-launcher-seed


def window_per_request(request_id, num_steps, window_size):
    rng = random.Random(hash(request_id))  # expect: non-launcher-seed
    start = rng.randint(0, num_steps - window_size)
    return start, window_size


def window_from_global_random(num_steps, window_size):
    window_start = random.randint(0, num_steps - window_size)  # expect: non-launcher-seed
    return window_start


def noise_seed_from_numpy(prompts):
    noise_seed = np.random.randint(0, 2**31 - 1)  # expect: non-launcher-seed
    return [(prompt, noise_seed) for prompt in prompts]


def window_from_torch_global(num_steps, window_size):
    sde_window = torch.randint(0, num_steps - window_size + 1, (1,)).item()  # expect: non-launcher-seed
    return sde_window


def draw_sde_window(num_steps, window_size):
    rng = random.Random()
    start = rng.randrange(num_steps - window_size + 1)  # expect: non-launcher-seed
    return start


def seed_from_clock():
    seed = int(time.time() * 1000) % 2**32  # expect: non-launcher-seed
    return seed


def seed_from_environment(base_seed):
    torch.cuda.manual_seed_all(base_seed + int(os.environ.get("RANK", "0")))  # expect: non-launcher-seed


def accelerate_seed(config):
    set_seed(config.seed, device_specific=True)  # expect: non-launcher-seed


def sample_batch(pipeline, prompts):
    return pipeline(prompts, seed=random.getrandbits(32))  # expect: non-launcher-seed


class RolloutWorker:
    def __init__(self, config):
        self.rank = int(os.environ.get("RANK", "0"))
        self.config = config

    def make_seeds(self, batch_size):
        return [self.config.seed * 1000 + self.rank * batch_size + i for i in range(batch_size)]  # expect: non-launcher-seed
