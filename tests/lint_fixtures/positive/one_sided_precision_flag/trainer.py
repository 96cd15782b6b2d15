"""one-sided-precision-flag, trainer side (by file name).

Lint fixture: parsed, never imported or run.
"""

import torch


def main(config):
    torch.use_deterministic_algorithms(True)  # expect: one-sided-precision-flag
    torch.backends.cudnn.benchmark = False  # expect: one-sided-precision-flag
    return config
