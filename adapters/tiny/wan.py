# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Tiny offline Wan: a seeded diffusers `WanTransformer3DModel` (or Wan 2.2's two experts) and its prompt encoder.

* `load_wan()`: diffusers' `WanTransformer3DModel` from [`TINY_WAN_CONFIG`] (2 blocks, 2 heads of 12, 16 latent
  channels as Wan 2.1 / Wan 2.2 A14B, `(1, 2, 2)` patches, 3-D RoPE axes 4/4/4, text width 32): a forward of 4
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
from pathlib import Path
from typing import Any

import torch
from diffusers import WanTransformer3DModel
from torch import nn

from rollout_consistency.adapters.families import load_scheduler_config
from rollout_consistency.adapters.wan import TEXT_KEYS, WAN_SCHEDULER_CONFIG, WanExperts
from rollout_consistency.adapters.wan import load_transformer as load_wan_directory

from .qwen_image import TinyPromptEncoder, TinyTransformer

__all__ = [
    "TINY_WAN_CONFIG",
    "TINY_WAN_TEXT_LENGTH",
    "TinyUMT5Encoder",
    "load_wan",
    "load_wan_scheduler_config",
    "save_tiny_wan_directory",
    "tiny_wan_prompt_encoder",
]

# Head dim 12: Wan's RoPE splits it into 4 (frames) + 4 (height) + 4 (width). (vLLM-omni 0.30 splits a head dim d
# as [d - 2(d//3), d//3, d//3] where diffusers builds [d - 4(d//6), 2(d//6), 2(d//6)]: the same for 12 and for the released
# 128, not for 16.)
TINY_WAN_CONFIG: Mapping[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 12,
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


_TINY_WAN = TinyTransformer(WanTransformer3DModel, TINY_WAN_CONFIG)


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

    Arguments as [`TinyTransformer`] (`path`: a diffusers Wan directory, `transformer/` and, for Wan 2.2 A14B,
    `transformer_2/`), and `boundary_ratio`: `None`: one expert (a `WanTransformer3DModel`, as Wan 2.1 / TI2V-5B).
    A ratio: Wan 2.2's two experts ([`WanExperts`]) switching at it (for a directory: overrides its
    `model_index.json`). Returns the model in eval mode.
    """
    if path is not None:
        return load_wan_directory(path, dtype=dtype, device=device, boundary_ratio=boundary_ratio)

    def build(weight_seed: int) -> WanTransformer3DModel:
        return _TINY_WAN(dtype=dtype, device=device, seed=weight_seed, config=config)

    if boundary_ratio is None:
        return build(seed)
    return WanExperts(build(seed), build(_expert_seed(seed)), boundary_ratio).eval()


def load_wan_scheduler_config(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Scheduler config: the flow-matching one RL trainers sample Wan with (static shift 5) when `path` is None, else
    read from the model directory (a released Wan directory's UniPC config: the Wan family reads its `flow_shift`)."""
    return dict(WAN_SCHEDULER_CONFIG) if path is None else load_scheduler_config(path)


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


def save_tiny_wan_directory(
    path: str | os.PathLike, *, dtype: torch.dtype = torch.float32, boundary_ratio: float | None = 0.875
) -> Path:
    """A complete, seeded, offline diffusers Wan directory (what vLLM-omni's `Wan22Pipeline` loads), under 1 MB.

    The transformer(s) are [`load_wan`]'s tiny ones (two experts with `boundary_ratio`, recorded in
    `model_index.json`); the text encoder a one-layer UMT5 of width `text_dim` behind a word-level tokenizer (the
    tiny encoder's vocabulary, `</s>` and `<pad>`); the VAE a 16-channel `AutoencoderKLWan` (spatial 8, temporal
    4); the scheduler Wan's flow-matching config. Every component is saved in `dtype`. Needs `transformers` (the
    `dev` extra; imported here only).
    """
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    from .qwen_image import _VOCAB_WORDS

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in _VOCAB_WORDS:
        vocab.setdefault(word, len(vocab))
    words = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    width = TINY_WAN_CONFIG["text_dim"]
    with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's RNG untouched
        torch.manual_seed(0)
        text_encoder = UMT5EncoderModel(
            UMT5Config(vocab_size=len(vocab), d_model=width, d_kv=16, d_ff=2 * width, num_layers=1, num_heads=2)
        )
        vae = AutoencoderKLWan(
            base_dim=8,
            z_dim=TINY_WAN_CONFIG["in_channels"],
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            latents_mean=[0.0] * TINY_WAN_CONFIG["in_channels"],
            latents_std=[1.0] * TINY_WAN_CONFIG["in_channels"],
        )
    model = load_wan(boundary_ratio=boundary_ratio)
    experts = (
        {"transformer": model}
        if boundary_ratio is None
        else {"transformer": model.transformer, "transformer_2": model.transformer_2, "boundary_ratio": boundary_ratio}
    )
    pipeline = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder.eval(),
        vae=vae.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(**WAN_SCHEDULER_CONFIG),
        **experts,
    )
    for module in (text_encoder, vae, *(m for m in experts.values() if isinstance(m, nn.Module))):
        nn.Module.to(module, dtype=dtype)  # diffusers' ModelMixin.to warns about `_keep_in_fp32_modules`
    path = Path(path)
    pipeline.save_pretrained(path, safe_serialization=True)
    return path
