"""rng-unsafe-recompute: every line marked `# expect: <rule>` must be reported (and nothing else).

Lint fixture: parsed, never imported or run.
"""

import torch
from torch.autograd import Function


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.enable_grad():
            outputs = ctx.run_function(*inputs)  # expect: rng-unsafe-recompute
        torch.autograd.backward(outputs, grad_outputs)
        return (None, *(x.grad for x in inputs))


class BlockRecompute(Function):
    @staticmethod
    def forward(ctx, block, hidden):
        ctx.block, ctx.scale = block, 1.0
        ctx.save_for_backward(hidden)
        with torch.no_grad():
            return block(hidden)

    @staticmethod
    def backward(ctx, grad):
        (hidden,) = ctx.saved_tensors
        block, scale = ctx.block, ctx.scale
        hidden = hidden.detach().requires_grad_()
        out = block(hidden)  # expect: rng-unsafe-recompute
        (grad_hidden,) = torch.autograd.grad(out, hidden, grad)
        return None, grad_hidden * scale


def hook_checkpoint(function, hidden):
    """A helper that recomputes in a gradient hook instead of an autograd.Function."""
    with torch.no_grad():
        out = function(hidden)
    out.requires_grad_()

    def backward_hook(grad):
        with torch.enable_grad():
            rerun = function(hidden.detach().requires_grad_())  # expect: rng-unsafe-recompute
        rerun.backward(grad)

    out.register_hook(backward_hook)
    return out


def checkpoint_blocks(blocks, hidden):
    for block in blocks:
        hidden = torch.utils.checkpoint.checkpoint(
            block, hidden, use_reentrant=False, preserve_rng_state=False  # expect: rng-unsafe-recompute
        )
    return hidden
