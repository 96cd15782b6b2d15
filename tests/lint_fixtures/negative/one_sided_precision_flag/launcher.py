"""one-sided-precision-flag near misses: set once in a launcher both sides run (shared), and the two sides
setting the same values. The launcher imports both sides: one program.

Lint fixture: parsed, never imported or run.
"""

import torch

from rollout_worker import build_engine
from trainer import main


def launch(config, role):
    torch.backends.cudnn.benchmark = False
    if role == "rollout":
        torch.backends.cudnn.allow_tf32 = False
        return build_engine(config.model_path)
    torch.backends.cudnn.allow_tf32 = False
    return main()
