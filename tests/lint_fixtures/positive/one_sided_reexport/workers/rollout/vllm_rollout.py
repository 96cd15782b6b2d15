"""The vLLM rollout: sets TF32 in the engine's process only. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


class vLLMRollout:
    def __init__(self, config):
        torch.backends.cuda.matmul.allow_tf32 = True  # expect: one-sided-precision-flag
        self.config = config
