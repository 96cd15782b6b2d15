# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""REPRODUCTION OF A KNOWN PITFALL — never use `rng_unsafe_checkpoint` for training.

This public module holds the pieces that tests, `scripts/demo_checkpoint_divergence.py`, the CLI example and
docs/training-consistency.md share to show a known training failure: a home-made gradient checkpoint whose
backward re-runs the forward with different random draws (dropout), so the gradients drift from the loss:

- `rng_unsafe_checkpoint`: a realistic home-made gradient checkpoint (store the inputs, run the
  segment under `no_grad`, re-run it in backward) that forgets to restore the RNG state, so dropout
  draws a different mask in the re-run and the gradients no longer belong to the loss.
- `ToyDenoiser`: a small flow-matching velocity model with dropout whose residual blocks go through
  an optional checkpoint function, like a diffusion transformer's blocks.
- `toy_flow_matching_batch`: seeded flow-matching training batches (x_t, t, v_target).
- `toy_case`: a factory for `rollout-consistency checkpointing` (see docs/training-consistency.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rollout_consistency.training.rng_state import isolated_rng

__all__ = ["ToyDenoiser", "rng_unsafe_checkpoint", "toy_case", "toy_flow_matching_batch"]


class _RngUnsafeCheckpoint(torch.autograd.Function):
    """Checkpoint in the style of early home-made helpers; the bug is marked below."""

    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.inputs = args
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        inputs = [
            arg.detach().requires_grad_(arg.requires_grad) if isinstance(arg, torch.Tensor) else arg
            for arg in ctx.inputs
        ]
        with torch.enable_grad():
            # BUG (the pitfall): the RNG state of the forward is not restored, so dropout inside
            # run_function draws a new mask and the recomputed graph is not the one that was run.
            # rollout-consistency: ignore[rng-unsafe-recompute] deliberate reproduction of the pitfall
            outputs = ctx.run_function(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs, strict=False) if out.requires_grad]
        torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])
        input_grads = tuple(inp.grad if isinstance(inp, torch.Tensor) and inp.requires_grad else None for inp in inputs)
        return (None, *input_grads)


def rng_unsafe_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Broken checkpoint helper (reproduction): recomputes `function(*args)` without restoring RNG.

    Same calling convention as `torch.utils.checkpoint.checkpoint(function, *args)`; positional
    tensor arguments only. Like the reentrant torch variant it yields no parameter gradients when no
    input requires grad.
    """
    return _RngUnsafeCheckpoint.apply(function, *args)


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(1000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    angles = 1000.0 * t[:, None].float() * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class _Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.dropout = nn.Dropout(dropout)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.fc2(self.dropout(nn.functional.gelu(self.fc1(self.norm(hidden)))))


class ToyDenoiser(nn.Module):
    """Flow-matching velocity model: v = f(x_t, t), residual MLP blocks with dropout.

    Args:
        dim: data dimension D.
        width: hidden width.
        depth: number of residual blocks (`blocks.0` ... `blocks.{depth-1}`).
        dropout: dropout probability inside every block.
        checkpoint_fn: when set and the model is training, each block runs as
            `checkpoint_fn(block, hidden)` (the calling convention of `torch.utils.checkpoint`).

    Forward:
        x_t: (B, D) float32 noisy sample. t: (B,) float32 in [0, 1]. Returns (B, D) float32 velocity.
    """

    def __init__(
        self,
        dim: int = 8,
        width: int = 64,
        depth: int = 3,
        dropout: float = 0.1,
        checkpoint_fn: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__()
        self.time_dim = 32
        self.proj_in = nn.Linear(dim, width)
        self.time_mlp = nn.Sequential(nn.Linear(self.time_dim, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(_Block(width, dropout) for _ in range(depth))
        self.norm_out = nn.LayerNorm(width)
        self.proj_out = nn.Linear(width, dim)
        self.checkpoint_fn = checkpoint_fn

    def forward(self, x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        hidden = self.proj_in(x_t) + self.time_mlp(_timestep_embedding(t, self.time_dim))
        for block in self.blocks:
            if self.checkpoint_fn is not None and self.training and torch.is_grad_enabled():
                hidden = self.checkpoint_fn(block, hidden)
            else:
                hidden = block(hidden)
        return self.proj_out(self.norm_out(hidden))


def toy_flow_matching_batch(
    generator: torch.Generator, batch_size: int, dim: int = 8, num_modes: int = 4
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rectified-flow training batch from a seeded mixture of Gaussians.

    The mixture centres come from a fixed seed (the data distribution never changes); the samples,
    noise and times come from `generator`. x_t = (1 - t)·x0 + t·ε, target v = ε − x0.

    Returns:
        x_t (B, D) float32, t (B,) float32, v_target (B, D) float32.
    """
    centres = torch.randn(num_modes, dim, generator=torch.Generator().manual_seed(1234)) * 2.0
    modes = torch.randint(num_modes, (batch_size,), generator=generator)
    x0 = centres[modes] + 0.3 * torch.randn(batch_size, dim, generator=generator)
    noise = torch.randn(batch_size, dim, generator=generator)
    t = torch.rand(batch_size, generator=generator)
    x_t = (1.0 - t[:, None]) * x0 + t[:, None] * noise
    return x_t, t, noise - x0


def toy_case(seed: int = 0, dropout: float = 0.1) -> dict[str, Any]:
    """Factory for `check_checkpointing` and `rollout-consistency checkpointing`.

    Returns a mapping with `module` (a `ToyDenoiser` seeded from `seed`), `inputs` ((x_t, t)),
    `loss_fn` (MSE to the flow-matching target) and `segments` (`["blocks.*"]`).
    """
    with isolated_rng(seed):  # weight init draws from the default generator; leave the caller's alone
        model = ToyDenoiser(dropout=dropout)
    x_t, t, target = toy_flow_matching_batch(torch.Generator().manual_seed(seed + 1), batch_size=32)
    return {
        "module": model,
        "inputs": (x_t, t),
        "loss_fn": lambda v_pred: nn.functional.mse_loss(v_pred, target),
        "segments": ["blocks.*"],
    }
