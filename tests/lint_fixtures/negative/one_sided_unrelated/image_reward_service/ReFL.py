"""one-sided-precision-flag, false-positive class: a reward model's own training script that lives in the
same repository as a vLLM-served reward, linked to it by no import. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


class Trainer:
    def __init__(self, args):
        self.args = args
        if args.allow_tf32:
            torch.backends.cuda.matmul.allow_tf32 = True

    def train(self, loader):
        return [self.step(batch) for batch in loader]
