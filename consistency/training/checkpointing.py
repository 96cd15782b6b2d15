# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""A gradient-checkpoint helper that is safe to swap in for home-made ones.

Home-made checkpoint helpers (store the inputs, run the segment under `torch.no_grad()`, re-run it
in backward) usually forget the random-number state: the re-run draws new dropout masks, so the
gradients no longer belong to the loss that was computed. Nothing crashes; the run looks healthy for
thousands of steps and then the loss creeps up. `checkpoint` below is
`torch.utils.checkpoint.checkpoint` with the two settings that avoid this fixed:
`use_reentrant=False` and `preserve_rng_state=True`.

Usage (inside a model's forward)::

    from rollout_consistency.training.checkpointing import checkpoint

    for block in self.blocks:
        hidden = checkpoint(block, hidden, temb) if self.training else block(hidden, temb)

or with a diffusers model: `model.enable_gradient_checkpointing(checkpoint)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint

__all__ = ["checkpoint"]

_FIXED_OPTIONS = ("use_reentrant", "preserve_rng_state")


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    determinism_check: str = "default",
    debug: bool = False,
    **kwargs: Any,
) -> Any:
    """Run `function(*args, **kwargs)` without storing its activations; recompute them in backward.

    A thin wrapper over `torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
    preserve_rng_state=True)`.

    Args:
        function: the segment, e.g. a transformer block (an `nn.Module` or any callable). May return a
            tensor or any nesting of tensors.
        *args: positional inputs of `function`; tensors of any dtype/device, other values pass as-is.
        determinism_check: forwarded to torch: `"default"` compares the shapes, dtypes and devices of
            the recomputed tensors with the original ones and raises on a mismatch; `"none"` skips it.
        debug: forwarded to torch: on a mismatch, print the operators of both runs.
        **kwargs: keyword inputs of `function` (tensors included), passed through unchanged.

    Returns:
        Whatever `function` returns.

    Guarantees:
        - The recompute in backward starts from the CPU RNG state and the RNG state of the device
          type of the tensor inputs (e.g. CUDA) that the forward started from, so dropout and any
          other draw from the *default* generators repeat exactly.
        - Gradients of parameters used inside `function` are produced even when no input requires
          grad (unlike the reentrant variant).
        - On the CPU, parameter gradients equal those of the same step without checkpointing bit for
          bit (tested in tests/test_recompute.py); on a GPU they are equal up to the determinism of
          the kernels themselves (`torch.use_deterministic_algorithms(True)` makes them equal).

    Not guaranteed:
        - Draws from a `torch.Generator` object you pass explicitly (e.g. `torch.randn(...,
          generator=g)`) are *not* replayed: the recompute draws the next numbers from `g`. Pass
          precomputed noise into the segment instead.
        - RNG states of more than one device type inside one segment (torch preserves one), and
          Python/NumPy random draws inside the segment.
        - Side effects inside `function` (in-place updates of buffers, e.g. BatchNorm running
          statistics, counters, prints) happen twice.

    Raises:
        TypeError: `use_reentrant` or `preserve_rng_state` passed; this helper exists to fix them.
    """
    fixed = [name for name in _FIXED_OPTIONS if name in kwargs]
    if fixed:
        raise TypeError(
            f"rollout_consistency.training.checkpointing.checkpoint always uses use_reentrant=False and "
            f"preserve_rng_state=True; remove {', '.join(fixed)} from the call (or call "
            "torch.utils.checkpoint.checkpoint directly if you need other settings)"
        )
    return torch.utils.checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        determinism_check=determinism_check,
        debug=debug,
        **kwargs,
    )
