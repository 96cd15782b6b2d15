"""rng-unsafe-recompute, the Function alone: a block wrapper written as an autograd.Function named for
recomputation, applied by the model (`RecomputeBlock.apply`), with no helper function beside it. Its backward
re-runs the block under enable_grad without restoring the RNG, so dropout draws a new mask. Written for the
lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch
from torch import nn


class RecomputeBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block, hidden):
        ctx.block = block
        ctx.save_for_backward(hidden)
        with torch.no_grad():
            return block(hidden)

    @staticmethod
    def backward(ctx, grad_output):
        (hidden,) = ctx.saved_tensors
        hidden = hidden.detach().requires_grad_(True)
        with torch.enable_grad():
            output = ctx.block(hidden)  # expect: rng-unsafe-recompute
        grads = torch.autograd.grad(output, (hidden, *ctx.block.parameters()), grad_output, allow_unused=True)
        return (None, *grads[:1])


class Transformer(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, hidden):
        for block in self.blocks:
            hidden = RecomputeBlock.apply(block, hidden)
        return hidden
