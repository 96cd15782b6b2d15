"""one-sided-precision-flag near misses, rollout side: both sides set the same values.

Lint fixture: parsed, never imported or run.
"""

import torch

torch.backends.cuda.matmul.allow_tf32 = False
torch.use_deterministic_algorithms(True)


def build_engine(model_path):
    return torch.load(model_path)
