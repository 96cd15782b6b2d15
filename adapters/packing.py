# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The 2x2 latent packing shared by Qwen-Image and FLUX: `(B, C, h, w)` <-> `(B, (h/2)(w/2), 4C)`."""

from __future__ import annotations

import torch

__all__ = ["pack_latents", "packed_latent_grid", "unpack_latents"]


def packed_latent_grid(height: int, width: int, vae_scale_factor: int, *, family_label: str) -> tuple[int, int]:
    """Unpacked latent height and width `(h, w)` (both even) of a `height x width`-pixel image, for a family whose
    latents are packed 2x2 (Qwen-Image, FLUX). ValueError unless both are positive multiples of
    `2 * vae_scale_factor`."""
    scale = int(vae_scale_factor)
    if height % (2 * scale) or width % (2 * scale) or height <= 0 or width <= 0:
        raise ValueError(
            f"{family_label} image size {height}x{width} must be positive multiples of 2*vae_scale_factor = "
            f"{2 * scale} (the latents are packed 2x2)."
        )
    return height // scale, width // scale


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """`(B, C, h, w)` → `(B, (h/2)(w/2), 4C)`, as diffusers' `QwenImagePipeline._pack_latents` and `FluxPipeline._pack_latents`."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """`(B, (h/2)(w/2), 4C)` → `(B, C, h, w)` (inverse of [`pack_latents`])."""
    b, _, channels = latents.shape
    latents = latents.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, h, w)
