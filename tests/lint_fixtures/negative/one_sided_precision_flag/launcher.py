"""one-sided-precision-flag near misses: set once in a launcher both sides run (shared).

Lint fixture: parsed, never imported or run.
"""

import torch


def launch(config, role):
    torch.backends.cudnn.benchmark = False
    if role == "rollout":
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.backends.cudnn.allow_tf32 = False
    return config
