"""one-sided-precision-flag near miss: one process that samples and trains (Flow-GRPO style) is shared.

Lint fixture: parsed, never imported or run.
"""

import torch

torch.backends.cudnn.deterministic = True


def sample_rollouts(pipeline, prompts):
    return pipeline(prompts)


def train_step(model, batch):
    return model(batch).mean()
