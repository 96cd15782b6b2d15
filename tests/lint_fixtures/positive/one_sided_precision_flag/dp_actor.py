"""one-sided-precision-flag, trainer side: the FSDP actor. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


class DataParallelDiffusionActor:
    def __init__(self, config, module):
        self.config = config
        self.module = module
        torch.use_deterministic_algorithms(True)  # expect: one-sided-precision-flag
        torch.backends.cudnn.benchmark = False  # expect: one-sided-precision-flag

    def compute_log_prob(self, batch):
        return self.module.log_prob(batch["latents"], batch["next_latents"], batch["timesteps"])
