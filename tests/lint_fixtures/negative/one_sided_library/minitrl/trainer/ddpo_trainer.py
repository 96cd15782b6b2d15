"""A single-process DDPO trainer (it samples and trains in one process): its TF32 setting covers both halves.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from dataclasses import dataclass

import torch

from .utils import pad


@dataclass
class DDPOConfig:
    allow_tf32: bool = True
    mixed_precision: str = "fp16"


class DDPOTrainer:
    def __init__(self, config, reward_function, sd_pipeline):
        self.config = config
        self.sd_pipeline = sd_pipeline
        if config.allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
        self.reward_function = reward_function
        self.pad = pad
