"""rng-unsafe-recompute near misses: the fix by hand, an analytic backward, torch.utils.checkpoint with its
RNG preserved, a helper that restores the RNG. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch
import torch.utils.checkpoint


class RngSafeCheckpoint(torch.autograd.Function):
    """The fix, by hand: save the RNG state in forward, restore it around the re-run."""

    @staticmethod
    def forward(ctx, run_function, *args):
        ctx.run_function = run_function
        ctx.cpu_rng_state = torch.get_rng_state()
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        inputs = [x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(ctx.cpu_rng_state)
            with torch.enable_grad():
                outputs = ctx.run_function(*inputs)
        torch.autograd.backward(outputs, grad_outputs)
        return (None, *(x.grad for x in inputs))


class ScaleGradient(torch.autograd.Function):
    """An analytic backward: nothing is re-run."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None
        return grad * ctx.scale, None


def checkpoint(block, hidden):
    return torch.utils.checkpoint.checkpoint(block, hidden, use_reentrant=False)


def maybe_checkpoint(block, hidden, training):
    return checkpoint(block, hidden) if training else block(hidden)


def checkpoint_sequential_blocks(blocks, hidden):
    return torch.utils.checkpoint.checkpoint_sequential(
        blocks, 2, hidden, use_reentrant=False, preserve_rng_state=True
    )


def recompute_with_rng(function, hidden):
    state = torch.get_rng_state()
    with torch.no_grad():
        out = function(hidden)
    out.requires_grad_()

    def backward_hook(grad):
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(state)
            with torch.enable_grad():
                rerun = function(hidden.detach().requires_grad_())
        rerun.backward(grad)

    out.register_hook(backward_hook)
    return out


def enable_checkpointing(transformer, checkpoint_fn):
    for block in transformer.blocks:
        original = block.forward

        def forward(*args, _original=original):
            return checkpoint_fn(_original, *args)

        block.forward = forward
