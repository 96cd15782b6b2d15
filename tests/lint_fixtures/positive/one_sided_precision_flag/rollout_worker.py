"""one-sided-precision-flag, rollout side (by file name): every `# expect: <rule>` line must be reported.

Lint fixture: parsed, never imported or run.
"""

import torch

torch.backends.cuda.matmul.allow_tf32 = True  # expect: one-sided-precision-flag
torch.backends.cudnn.benchmark = True  # expect: one-sided-precision-flag


def build_engine(model_path):
    return torch.load(model_path)
