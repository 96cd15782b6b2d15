# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Tiny offline SD3 and FLUX: seeded diffusers transformers from fixed configs, and their prompt encoder.

* `load_sd3()`: diffusers' `SD3Transformer2DModel` (2 joint blocks, width 16, 4 latent channels, 2x2
  patches). `load_flux()`: diffusers' `FluxTransformer2DModel` (1 double-stream + 1 single-stream block,
  2 heads of 16, 16 latent channels packed 2x2 into 64 as FLUX.1, guidance embedding on as FLUX.1-dev;
  `load_flux(config={**TINY_FLUX_CONFIG, "guidance_embeds": False})` is a schnell-like one without it). A forward at
  batch 4 on a 64x64-px image (8x8 latent) takes about 2 ms on a CPU. A real model directory goes through
  the same functions: `load_sd3(path)` / `load_flux(path)` are `from_pretrained(path,
  subfolder="transformer")` (or the directory itself).
* `load_sd3_scheduler_config()` / `load_flux_scheduler_config()`: the scheduler config each tiny model runs with,
  SD3's and FLUX.1's released ones, as `from_pretrained(path, subfolder="scheduler")` reads them (from `path`'s
  `scheduler/scheduler_config.json` when a model directory is given).
* [`TinyClipT5Encoder`]: the two families condition on a fixed-length sequence of T5 token embeddings
  (`prompt_embeds`) and a pooled CLIP vector (`pooled_prompt_embeds`), with no text mask. The stand-in
  builds the sequence from the project's word-level `TinyPromptEncoder` (in-memory `tokenizers` tokenizer
  + seeded embedding, `rollout_consistency.adapters.tiny.qwen_image`) padded to a fixed `max_length`, as the pipelines pad to
  `max_sequence_length`; the pooled vector is `tanh(mean of the prompt's token embeddings @ P)` with a
  seeded projection `P`. Everything is a pure function of the prompts and the seed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

from rollout_consistency.adapters.families import load_scheduler_config
from rollout_consistency.adapters.flux import FLUX_SCHEDULER_CONFIG
from rollout_consistency.adapters.sd3 import SD3_SCHEDULER_CONFIG

from .qwen_image import TinyPromptEncoder, TinyTransformer

__all__ = [
    "TINY_FLUX_CONFIG",
    "TINY_SD3_CONFIG",
    "TINY_TEXT_LENGTH",
    "TinyClipT5Encoder",
    "load_flux",
    "load_flux_scheduler_config",
    "load_sd3",
    "load_sd3_scheduler_config",
    "tiny_flux_prompt_encoder",
    "tiny_sd3_prompt_encoder",
]

TINY_SD3_CONFIG: Mapping[str, Any] = {
    "sample_size": 8,
    "patch_size": 2,
    "in_channels": 16,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 16,
    "pooled_projection_dim": 16,
    "out_channels": 16,
    "pos_embed_max_size": 16,
}
# RoPE axes (4, 6, 6) sum to the head dim 16.
TINY_FLUX_CONFIG: Mapping[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 1,
    "num_single_layers": 1,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 16,
    "guidance_embeds": True,
    "axes_dims_rope": (4, 6, 6),
}
TINY_TEXT_LENGTH = 16  # the tiny encoders' fixed text length (the pipelines' max_sequence_length)


#: The SD3 transformer (`SD3Transformer2DModel`; the tiny one from [`TINY_SD3_CONFIG`]).
load_sd3 = TinyTransformer(SD3Transformer2DModel, TINY_SD3_CONFIG)
#: The FLUX transformer (`FluxTransformer2DModel`; the tiny one from [`TINY_FLUX_CONFIG`]).
load_flux = TinyTransformer(FluxTransformer2DModel, TINY_FLUX_CONFIG)


def load_sd3_scheduler_config(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Scheduler config: SD3's released one (static shift 3) when `path` is None, else read from the model directory."""
    return dict(SD3_SCHEDULER_CONFIG) if path is None else load_scheduler_config(path)


def load_flux_scheduler_config(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Scheduler config: FLUX.1's released one (dynamic shifting) when `path` is None, else read from the model
    directory."""
    return dict(FLUX_SCHEDULER_CONFIG) if path is None else load_scheduler_config(path)


class TinyClipT5Encoder:
    """Prompts → `prompt_embeds` `(B, max_length, embedding_dim)` and `pooled_prompt_embeds` `(B, pooled_dim)`, float32.

    Args:
        embedding_dim: width of `prompt_embeds` (the transformer's `joint_attention_dim`).
        pooled_dim: width of `pooled_prompt_embeds` (the transformer's `pooled_projection_dim`).
        max_length: fixed text length every prompt is padded to (zero rows past the prompt's words).
        seed: seeds the token embedding and the pooling projection.
    """

    def __init__(self, embedding_dim: int, pooled_dim: int, *, max_length: int = TINY_TEXT_LENGTH, seed: int = 0):
        self.words = TinyPromptEncoder(embedding_dim, seed=seed)
        self.max_length = int(max_length)
        # A seed of its own for the projection, derived from `seed`, so that it is not the embedding's draws.
        derived = int.from_bytes(hashlib.sha256(f"tiny-clip-pooled/{seed}".encode()).digest()[:8], "little")
        generator = torch.Generator().manual_seed(derived)
        self.projection = torch.randn(embedding_dim, pooled_dim, generator=generator) / embedding_dim**0.5

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """`(prompt_embeds (B, max_length, D), pooled_prompt_embeds (B, P))`, float32.

        Raises:
            ValueError: a prompt has more than `max_length` tokens (shorten it or raise `max_length`).
        """
        embeds, mask = self.words.encode(prompts, pad_to=self.max_length)
        mean = embeds.sum(dim=1) / mask.sum(dim=1, keepdim=True)
        return embeds, torch.tanh(mean @ self.projection)

    def conditioning(
        self, prompts: Sequence[str], negative_prompts: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """SD3 / FLUX conditioning: `prompt_embeds`, `pooled_prompt_embeds` (+ `negative_*` when given)."""
        embeds, pooled = self.encode(prompts)
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
        if negative_prompts is not None:
            if len(negative_prompts) != len(prompts):
                raise ValueError(f"{len(negative_prompts)} negative prompts for {len(prompts)} prompts.")
            out["negative_prompt_embeds"], out["negative_pooled_prompt_embeds"] = self.encode(negative_prompts)
        return out


def tiny_sd3_prompt_encoder(*, seed: int = 0, max_length: int = TINY_TEXT_LENGTH) -> TinyClipT5Encoder:
    """Encoder for the tiny SD3 model: `prompt_embeds` (B, max_length, 32), `pooled_prompt_embeds` (B, 16)."""
    return _encoder_for(TINY_SD3_CONFIG, seed, max_length)


def tiny_flux_prompt_encoder(*, seed: int = 0, max_length: int = TINY_TEXT_LENGTH) -> TinyClipT5Encoder:
    """Encoder for the tiny FLUX model: `prompt_embeds` (B, max_length, 32), `pooled_prompt_embeds` (B, 16)."""
    return _encoder_for(TINY_FLUX_CONFIG, seed, max_length)


def _encoder_for(config: Mapping[str, Any], seed: int, max_length: int) -> TinyClipT5Encoder:
    """The stand-in encoder whose widths fit a transformer of `config` (`joint_attention_dim`, `pooled_projection_dim`)."""
    return TinyClipT5Encoder(
        config["joint_attention_dim"], config["pooled_projection_dim"], max_length=max_length, seed=seed
    )
