"""rng-unsafe-recompute, false-positive class: a Function that re-runs a fixed, dropout-free computation in
backward to save memory (verl's tiled MLP), not a checkpoint wrapper around any block. Written for the lint's
tests.

Lint fixture: parsed, never imported or run.
"""

import torch


class TiledMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, module, x, shards):
        ctx.fn, ctx.module, ctx.shards = fn, module, shards
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, shard) for shard in torch.chunk(x, chunks=shards, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, *grads):
        fn = ctx.fn
        module = ctx.module
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_(True)
        for x_shard, grad_shard in zip(torch.chunk(x, ctx.shards, dim=-2), torch.chunk(grads[0], ctx.shards, dim=-2)):
            with torch.enable_grad():
                output = fn(module, x_shard)
            torch.autograd.backward(output, grad_shard)
        return None, None, x.grad, None
