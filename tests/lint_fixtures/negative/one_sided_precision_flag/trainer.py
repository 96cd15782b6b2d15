"""one-sided-precision-flag near misses, trainer side: the same settings, spelt differently.

Lint fixture: parsed, never imported or run.
"""

import torch


def main():
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True)
