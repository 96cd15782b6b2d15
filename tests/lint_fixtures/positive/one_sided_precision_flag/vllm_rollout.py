"""one-sided-precision-flag, rollout side: a vLLM rollout worker (its own processes). Written for the lint's
tests, shaped like verl's workers.

Lint fixture: parsed, never imported or run.
"""

import torch

torch.backends.cudnn.benchmark = True  # expect: one-sided-precision-flag


class vLLMDiffusionRollout:
    def __init__(self, config, engine):
        self.config = config
        self.engine = engine
        torch.backends.cuda.matmul.allow_tf32 = True  # expect: one-sided-precision-flag

    def generate_sequences(self, prompts):
        return self.engine.generate(prompts)
