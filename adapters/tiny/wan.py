# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Tiny offline Wan: a seeded diffusers `WanTransformer3DModel` (or Wan 2.2's two experts) and its prompt encoder.

* `load_wan()`: diffusers' `WanTransformer3DModel` from [`TINY_WAN_CONFIG`] (2 blocks, 2 heads of 16, 16 latent
  channels as Wan 2.1 / Wan 2.2 A14B, `(1, 2, 2)` patches, 3-D RoPE axes 8/4/4, text width 32): a forward of 4
  videos of 13 frames at 64x64 px (latents `(16, 4, 8, 8)`, 64 tokens) takes a few ms on a CPU.
  `load_wan(boundary_ratio=r)` gives Wan 2.2's two experts (`rollout_consistency.adapters.wan.WanExperts`): the
  high-noise expert from `seed`, the low-noise expert from a seed derived from it, so the experts differ and a
  step scored by the wrong one shows. `load_wan(path)` loads a real directory through the same function.
* [`TinyUMT5Encoder`]: Wan conditions on UMT5 token embeddings zero-padded to a fixed `max_sequence_length`, with
  no text mask. The stand-in is the project's word-level `TinyPromptEncoder` (in-memory `tokenizers` tokenizer +
  seeded embedding) padded to a fixed `max_length`, zero rows past the prompt's words, as
  `WanPipeline._get_t5_prompt_embeds` pads. Everything is a pure function of the prompts and the seed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers import WanTransformer3DModel
from torch import nn

from rollout_consistency.adapters.wan import TEXT_KEYS, WanExperts
from rollout_consistency.adapters.wan import load_transformer as load_wan_directory

from .qwen_image import TinyPromptEncoder, load_transformer

__all__ = ["TINY_WAN_CONFIG", "TINY_WAN_TEXT_LENGTH", "TinyUMT5Encoder", "load_wan", "tiny_wan_prompt_encoder"]

# Head dim 16: Wan's RoPE splits it into 8 (frames) + 4 (height) + 4 (width).
TINY_WAN_CONFIG: Mapping[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 2,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 64,
}
TINY_WAN_TEXT_LENGTH = 16  # the tiny encoder's fixed text length (the pipeline's max_sequence_length)


def _expert_seed(seed: int) -> int:
    """The low-noise expert's weight seed: derived from `seed`, so that its weights are not the high-noise one's."""
    return int.from_bytes(hashlib.sha256(f"tiny-wan-transformer_2/{seed}".encode()).digest()[:8], "little") >> 1


def load_wan(
    path: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
    boundary_ratio: float | None = None,
) -> nn.Module:
    """The Wan transformer: tiny and seeded when `path` is None, else loaded from a local directory.

    Args:
        path: a diffusers Wan directory (`transformer/`, and `transformer_2/` for Wan 2.2 A14B), or `None` for the
            tiny model.
        dtype: parameter dtype (`torch.float32` or `torch.bfloat16`); the adapters cast inputs to it.
        device: where to put the model. seed: weight seed of the tiny model (ignored when loading).
        config: override the tiny config (ignored when loading).
        boundary_ratio: `None`: one expert (a `WanTransformer3DModel`, as Wan 2.1 / TI2V-5B). A ratio: Wan 2.2's
            two experts ([`WanExperts`]) switching at it (for a directory: overrides its `model_index.json`).

    Returns:
        The model in eval mode.
    """
    if path is not None:
        return load_wan_directory(path, dtype=dtype, device=device, boundary_ratio=boundary_ratio)

    def build(weight_seed: int) -> WanTransformer3DModel:
        return load_transformer(
            WanTransformer3DModel, TINY_WAN_CONFIG, None, dtype=dtype, device=device, seed=weight_seed, config=config
        )

    if boundary_ratio is None:
        return build(seed)
    return WanExperts(build(seed), build(_expert_seed(seed)), boundary_ratio).eval()


class TinyUMT5Encoder:
    """Prompts → `prompt_embeds` `(B, max_length, embedding_dim)` float32, zero rows past each prompt's words.

    Args:
        embedding_dim: the transformer's `text_dim`. max_length: the fixed text length (`max_sequence_length`).
        seed: seeds the token embedding.
    """

    def __init__(self, embedding_dim: int, *, max_length: int = TINY_WAN_TEXT_LENGTH, seed: int = 0):
        self.words = TinyPromptEncoder(embedding_dim, seed=seed)
        self.max_length = int(max_length)

    @torch.no_grad()
    def encode(self, prompts: Sequence[str]) -> torch.Tensor:
        """`prompt_embeds (B, max_length, D)`; ValueError for a prompt longer than `max_length` tokens."""
        embeds, _ = self.words.encode(prompts, pad_to=self.max_length)
        return embeds

    def conditioning(
        self, prompts: Sequence[str], negative_prompts: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Wan conditioning: `prompt_embeds` (+ `negative_prompt_embeds` when given)."""
        out = {TEXT_KEYS[0]: self.encode(prompts)}
        if negative_prompts is not None:
            if len(negative_prompts) != len(prompts):
                raise ValueError(f"{len(negative_prompts)} negative prompts for {len(prompts)} prompts.")
            out[TEXT_KEYS[1]] = self.encode(negative_prompts)
        return out


def tiny_wan_prompt_encoder(*, seed: int = 0, max_length: int = TINY_WAN_TEXT_LENGTH) -> TinyUMT5Encoder:
    """Encoder for the tiny Wan model: `prompt_embeds` (B, max_length, 32)."""
    return TinyUMT5Encoder(TINY_WAN_CONFIG["text_dim"], max_length=max_length, seed=seed)
