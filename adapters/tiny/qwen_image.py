# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The embedded default: a tiny offline Qwen-Image transformer and a tiny prompt encoder.

Both are real components built from fixed configs with seeded weights, so everything runs on a CPU with
no model hub: the transformer is diffusers' `QwenImageTransformer2DModel` (via
[`QwenImageTransformerTxtSeqLens`], which only adds the optional `txt_seq_lens` argument) at a few ms per
forward; the prompt encoder is a `tokenizers` word-level tokenizer held in memory plus a seeded embedding,
so prompts of different word counts give embeddings of different lengths with a padding mask, as Qwen-Image's
text encoder does.

A real model directory goes through the same functions: `load_qwen_image(path)` is
`from_pretrained(path, subfolder="transformer")` (or the directory itself), and
`load_qwen_image_scheduler_config(path)` reads `scheduler/scheduler_config.json`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from torch import nn

from rollout_consistency.adapters.families import load_pretrained_transformer, load_scheduler_config
from rollout_consistency.adapters.qwen_image import QWEN_IMAGE_SCHEDULER_CONFIG
from rollout_consistency.adapters.rope import QwenImageTransformerTxtSeqLens

ModelT = TypeVar("ModelT", bound=nn.Module)

__all__ = [
    "TINY_QWEN_IMAGE_CONFIG",
    "TinyPromptEncoder",
    "TinyTransformer",
    "load_qwen_image",
    "load_qwen_image_scheduler_config",
    "load_transformer",
    "save_tiny_qwen_image_directory",
]

# Tiny but structurally complete: 2 double-stream blocks, 2 heads of 16, 16 packed channels (4 latent
# channels x 2x2 patches), text width 32. RoPE axes sum to the head dim.
TINY_QWEN_IMAGE_CONFIG: Mapping[str, Any] = {
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 4,
    "num_layers": 2,
    "attention_head_dim": 16,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": (4, 6, 6),
}


def load_transformer(
    model_class: type[ModelT],
    tiny_config: Mapping[str, Any],
    path: str | os.PathLike | None,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    config: Mapping[str, Any] | None,
) -> ModelT:
    """A diffusers transformer: built from `config or tiny_config` with weights drawn from `seed` when `path`
    is None, else loaded from a local model directory (its `transformer/` subfolder, or the folder itself).

    Weights are drawn in float32 under a forked global RNG (the caller's RNG state is untouched), so the bf16
    model of a seed is the rounded float32 model. Returned on `device`, in `dtype`, in eval mode.
    """
    if path is not None:
        return load_pretrained_transformer(model_class, path, dtype=dtype, device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(**dict(config or tiny_config))
    # nn.Module.to: diffusers' ModelMixin.to warns about `_keep_in_fp32_modules` on every dtype cast.
    return nn.Module.to(model, device=device, dtype=dtype).eval()


@dataclass(frozen=True, eq=False)  # compared and hashed by identity, as the functions it stands for
class TinyTransformer(Generic[ModelT]):
    """A family's transformer loader, called as a function: tiny and seeded when `path` is None, else loaded from
    a local directory ([`load_transformer`]). `load_qwen_image`, `load_sd3` and `load_flux` are instances.

    Attributes:
        model_class: the diffusers transformer class.
        tiny_config: the tiny model's config (`rollout_consistency.adapters.tiny`'s `TINY_*_CONFIG`).
    """

    model_class: type[ModelT]
    tiny_config: Mapping[str, Any]

    def __call__(
        self,
        path: str | os.PathLike | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
        config: Mapping[str, Any] | None = None,
    ) -> ModelT:
        """The transformer, in eval mode.

        Args:
            path: a diffusers model directory (with a `transformer/` subfolder, or the transformer folder itself),
                or `None` for the tiny model.
            dtype: parameter dtype (`torch.float32` or `torch.bfloat16`); the adapters cast inputs to it.
            device: where to put the model.
            seed: weight seed of the tiny model (ignored when loading).
            config: override the tiny config (ignored when loading).
        """
        return load_transformer(
            self.model_class, self.tiny_config, path, dtype=dtype, device=device, seed=seed, config=config
        )


#: The Qwen-Image transformer: a `QwenImageTransformer2DModel` whose forward also accepts `txt_seq_lens`
#: (`rollout_consistency.adapters.rope`).
load_qwen_image = TinyTransformer(QwenImageTransformerTxtSeqLens, TINY_QWEN_IMAGE_CONFIG)


def load_qwen_image_scheduler_config(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Scheduler config: Qwen-Image's released one when `path` is None, else read from the model directory."""
    return dict(QWEN_IMAGE_SCHEDULER_CONFIG) if path is None else load_scheduler_config(path)


# A small fixed vocabulary; words outside it share [UNK]. Word count, not vocabulary, sets the length.
_VOCAB_WORDS = [
    "a",
    "an",
    "the",
    "of",
    "in",
    "on",
    "at",
    "with",
    "and",
    "or",
    "to",
    "from",
    "by",
    "for",
    "under",
    "over",
    "near",
    "behind",
    "above",
    "cat",
    "dog",
    "bird",
    "fish",
    "horse",
    "cow",
    "fox",
    "owl",
    "bear",
    "lion",
    "tiger",
    "robot",
    "person",
    "child",
    "woman",
    "man",
    "car",
    "boat",
    "train",
    "plane",
    "house",
    "tree",
    "flower",
    "mountain",
    "river",
    "lake",
    "sea",
    "sky",
    "sun",
    "moon",
    "star",
    "cloud",
    "city",
    "street",
    "forest",
    "garden",
    "field",
    "red",
    "orange",
    "yellow",
    "green",
    "blue",
    "purple",
    "pink",
    "black",
    "white",
    "gray",
    "brown",
    "golden",
    "silver",
    "bright",
    "dark",
    "small",
    "large",
    "tiny",
    "huge",
    "old",
    "new",
    "young",
    "happy",
    "sad",
    "quiet",
    "loud",
    "soft",
    "hard",
    "warm",
    "cold",
    "wet",
    "dry",
    "photo",
    "painting",
    "drawing",
    "sketch",
    "render",
    "portrait",
    "landscape",
    "closeup",
    "watercolor",
    "oil",
    "digital",
    "sitting",
    "standing",
    "running",
    "flying",
    "swimming",
    "sleeping",
    "reading",
    "walking",
    "jumping",
    "playing",
    "morning",
    "evening",
    "night",
    "winter",
    "summer",
    "spring",
    "autumn",
    "rain",
    "snow",
    "fog",
    "light",
    "shadow",
]


class TinyPromptEncoder(nn.Module):
    """In-memory word-level tokenizer + seeded embedding: a stand-in for Qwen-Image's text encoder.

    `encode(prompts)` returns `(prompt_embeds (B, L, D) float32, prompt_embeds_mask (B, L) int64)` padded to
    the longest prompt of the call (or to `pad_to`), padding rows zero, as diffusers' `QwenImagePipeline`
    returns them. `L` of a prompt is its word count (at least 1).
    """

    def __init__(
        self,
        embedding_dim: int = 32,
        *,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
        embedding: torch.Tensor | None = None,
    ):
        super().__init__()
        if tokenizer is None:
            vocab = {"[PAD]": 0, "[UNK]": 1}
            for word in _VOCAB_WORDS:
                vocab.setdefault(word, len(vocab))
            tokenizer = Tokenizer(WordLevel(vocab=vocab, unk_token="[UNK]"))
            tokenizer.pre_tokenizer = Whitespace()
        self.tokenizer = tokenizer
        vocab_size = tokenizer.get_vocab_size()
        if embedding is None:
            generator = torch.Generator().manual_seed(seed)
            embedding = torch.randn(vocab_size, embedding_dim, generator=generator, dtype=torch.float32)
        self.embedding = nn.Embedding.from_pretrained(embedding.to(torch.float32), freeze=True)

    @property
    def embedding_dim(self) -> int:
        return int(self.embedding.embedding_dim)

    def token_ids(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(re.sub(r"\s+", " ", prompt.lower()).strip() or "[UNK]").ids
        return ids or [self.tokenizer.token_to_id("[UNK]")]

    @torch.no_grad()
    def encode(self, prompts: Sequence[str], *, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Embed prompts; see the class docstring. `pad_to` pads wider than the longest prompt."""
        if isinstance(prompts, str):
            raise TypeError("encode() takes a list of prompts, not one string.")
        ids = [self.token_ids(p) for p in prompts]
        width = max(len(i) for i in ids)
        if pad_to is not None:
            if pad_to < width:
                raise ValueError(f"pad_to={pad_to} is narrower than the longest prompt ({width} tokens).")
            width = pad_to
        embeds = torch.zeros((len(ids), width, self.embedding_dim), dtype=torch.float32)
        mask = torch.zeros((len(ids), width), dtype=torch.int64)
        for row, token_ids in enumerate(ids):
            embeds[row, : len(token_ids)] = self.embedding(torch.tensor(token_ids))
            mask[row, : len(token_ids)] = 1
        return embeds, mask

    def conditioning(
        self, prompts: Sequence[str], negative_prompts: Sequence[str] | None = None, *, pad_to: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Qwen-Image conditioning dict: `prompt_embeds`, `prompt_embeds_mask` (+ `negative_*` when given)."""
        embeds, mask = self.encode(prompts, pad_to=pad_to)
        out = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}
        if negative_prompts is not None:
            if len(negative_prompts) != len(prompts):
                raise ValueError(f"{len(negative_prompts)} negative prompts for {len(prompts)} prompts.")
            neg, neg_mask = self.encode(negative_prompts, pad_to=pad_to)
            out.update(negative_prompt_embeds=neg, negative_prompt_embeds_mask=neg_mask)
        return out

    def save_pretrained(self, path: str | os.PathLike) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(path / "tokenizer.json"))
        save_file({"embedding": self.embedding.weight.detach().contiguous()}, str(path / "embedding.safetensors"))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> TinyPromptEncoder:
        path = Path(path)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        embedding = load_file(str(path / "embedding.safetensors"))["embedding"]
        return cls(embedding.shape[1], tokenizer=tokenizer, embedding=embedding)


def save_tiny_qwen_image_directory(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """A complete, seeded, offline diffusers Qwen-Image directory (what vLLM-omni loads), under 1 MB.

    Every component is saved in `dtype`, the dtype of the engine that will serve it. vLLM-omni's loader casts
    only the transformer and the VAE to the engine dtype; the text encoder keeps its saved dtype, and the
    stock path draws its latents in the prompt embeddings' dtype. A float32 text encoder under a bf16 engine
    therefore feeds float32 latents to the bf16 transformer, and the engine's start-up warm-up request fails
    ("mat1 and mat2 must have the same dtype"), as released Qwen-Image (all bf16) never does.

    The transformer is `rollout_consistency.adapters.tiny.load_qwen_image()`'s tiny model (same weights); the text encoder a one-layer
    Qwen2.5-VL of width `joint_attention_dim`; the tokenizer byte-level with Qwen's chat special tokens; the
    VAE a 4-channel `AutoencoderKLQwenImage` with scale factor 8; the scheduler Qwen-Image's config. Needs
    `transformers` (the `dev` extra; imported here only).
    """
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    vocab = {char: index for index, char in enumerate(sorted(ByteLevel.alphabet()))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], unk_token=None, bos_token=None, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    width = TINY_QWEN_IMAGE_CONFIG["joint_attention_dim"]
    with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's RNG untouched
        torch.manual_seed(0)
        text_encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config=dict(
                    vocab_size=len(tokenizer),
                    hidden_size=width,
                    intermediate_size=2 * width,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    max_position_embeddings=2048,
                    rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
                ),
                vision_config=dict(
                    depth=1,
                    hidden_size=16,
                    intermediate_size=32,
                    num_heads=2,
                    out_hidden_size=width,
                    fullatt_block_indexes=[0],
                ),
                vocab_size=len(tokenizer),
            )
        )
        vae = AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=4,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        )
    transformer = QwenImageTransformer2DModel(**TINY_QWEN_IMAGE_CONFIG)
    transformer.load_state_dict(load_qwen_image().state_dict())
    pipeline = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=vae.eval(),
        text_encoder=text_encoder.eval(),
        tokenizer=tokenizer,
        transformer=transformer.eval(),
    )
    # nn.Module.to: diffusers' ModelMixin.to warns about `_keep_in_fp32_modules` on every dtype cast.
    for module in (vae, text_encoder, transformer):
        nn.Module.to(module, dtype=dtype)
    path = Path(path)
    pipeline.save_pretrained(path, safe_serialization=True)
    return path
