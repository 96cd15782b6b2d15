# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What the SD3-lineage MMDiT families (SD3, FLUX) share: their text conditioning and their guidance.

Both take each text as sequence embeddings `(B, L, joint_attention_dim)` plus pooled embeddings
`(B, pooled_projection_dim)`, float32, named as their pipelines' `encode_prompt` returns them ([`TEXT_KEYS`]:
positive, then negative), and no text mask: their text encoders pad to a fixed length and the transformer
attends to every token, so embeddings are never re-padded. Both guide with a second forward on the negative
prompt, combined in float32 as `uncond + s (cond - uncond)` ([`guided_prediction`]); which setting holds `s`
differs (SD3: `guidance_scale`; FLUX: the family option `true_cfg_scale`, its `guidance_scale` being embedded).

Each family module keeps what differs: its latent layout, its schedule, its transformer call and its loaders.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .families import (
    PromptEncoder,
    check_pooled_text,
    concat_fixed_width_conditioning,
    encode_prompt_pairs,
    load_pretrained_transformer,
)
from .settings import PipelineSettings

__all__ = [
    "TEXT_KEYS",
    "MMDiTText",
    "check_text_conditioning",
    "collate_text_conditioning",
    "guided_prediction",
    "load_prompt_encoder",
    "load_text_pipeline",
    "load_transformer",
]

# (sequence embeddings, pooled embeddings) pairs: positive, then negative.
TEXT_KEYS = (
    ("prompt_embeds", "pooled_prompt_embeds"),
    ("negative_prompt_embeds", "negative_pooled_prompt_embeds"),
)


@dataclass(frozen=True)
class MMDiTText:
    """How one MMDiT family names its text and its guidance in messages.

    Attributes:
        label: the family in messages (`"SD3"`).
        pipeline: its diffusers pipeline class (`"StableDiffusion3Pipeline"`), whose text encoders it loads.
        transformer: its diffusers transformer class (`"SD3Transformer2DModel"`).
        cfg_name: the setting whose value > 1 turns on the negative forward (`"guidance_scale"`).
        cfg_label: what the pipeline calls that guidance (`"CFG"`, `"True CFG"`).
        cfg_hint: appended to the refusal of guidance without a negative prompt (`""`, or a sentence's tail).
    """

    label: str
    pipeline: str
    transformer: str
    cfg_name: str
    cfg_label: str
    cfg_hint: str = ""


def check_text_conditioning(
    text: MMDiTText,
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    batch: int,
    cfg_scale: float,
) -> None:
    """Refuse conditioning keys other than [`TEXT_KEYS`], a malformed positive text, and guidance
    (`cfg_scale > 1`) without a well-formed negative text.

    Raises:
        ValueError / TypeError naming the fix (see `rollout_consistency.adapters.families.check_pooled_text`).
    """
    known = {key for pair in TEXT_KEYS for key in pair}
    unknown = set(conditioning) - known
    if unknown:
        raise ValueError(
            f"Unknown {text.label} conditioning keys {sorted(unknown)}; expected {sorted(known)} ({text.label} takes "
            f"no text mask: its text encoders pad to a fixed length and the transformer attends to every token)."
        )
    check_pooled_text(transformer, conditioning, *TEXT_KEYS[0], batch, family_label=text.label)
    if cfg_scale > 1:
        if TEXT_KEYS[1][0] not in conditioning and TEXT_KEYS[1][1] not in conditioning:
            raise ValueError(
                f"{text.cfg_label} is on ({text.cfg_name}={cfg_scale} > 1) but no negative prompt was given: pass "
                f"'negative_prompt_embeds' and 'negative_pooled_prompt_embeds' (encode_prompt of the negative "
                f"prompt; an empty string is the pipeline's default), or set {text.cfg_name} <= 1{text.cfg_hint}."
            )
        check_pooled_text(transformer, conditioning, *TEXT_KEYS[1], batch, family_label=text.label)


def collate_text_conditioning(
    text: MMDiTText, conditionings: Sequence[Mapping[str, torch.Tensor]], width: int | None
) -> dict[str, torch.Tensor]:
    """Batch per-request conditionings for one forward: concatenation, no padding (no text mask, so requests
    must share one text width; see `rollout_consistency.adapters.families.concat_fixed_width_conditioning`)."""
    return concat_fixed_width_conditioning(
        conditionings, width, text_keys=[embeds for embeds, _ in TEXT_KEYS], pipeline=text.pipeline
    )


def guided_prediction(
    predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    conditioning: Mapping[str, torch.Tensor],
    cfg_scale: float,
) -> torch.Tensor:
    """`predict(embeds, pooled)` (float32) on the prompt; with `cfg_scale > 1` also on the negative prompt,
    combined in float32 as `uncond + cfg_scale · (cond − uncond)`."""
    cond = predict(conditioning["prompt_embeds"], conditioning["pooled_prompt_embeds"])
    if cfg_scale <= 1:
        return cond
    uncond = predict(conditioning["negative_prompt_embeds"], conditioning["negative_pooled_prompt_embeds"])
    return uncond + cfg_scale * (cond - uncond)


def load_transformer(text: MMDiTText, path: str | os.PathLike, *, dtype: torch.dtype, device: Any) -> nn.Module:
    """A model directory's `text.transformer` in eval mode (`rollout_consistency.adapters.families.load_pretrained_transformer`)."""
    import diffusers

    return load_pretrained_transformer(getattr(diffusers, text.transformer), path, dtype=dtype, device=device)


def load_text_pipeline(text: MMDiTText, path: str | os.PathLike, device: Any) -> Any:
    """A model directory's `text.pipeline` holding only its text encoders (transformer and VAE not loaded), on
    `device`: its `encode_prompt` is the checkpoint's own."""
    import diffusers

    return getattr(diffusers, text.pipeline).from_pretrained(path, transformer=None, vae=None).to(device)


def load_prompt_encoder(
    text: MMDiTText,
    encode: Callable[[Any, list[str], int], tuple[torch.Tensor, torch.Tensor]],
    path: str | os.PathLike,
    device: Any,
    settings: PipelineSettings,
) -> PromptEncoder:
    """The checkpoint's own CLIP and T5 encoders through `text.pipeline` ([`load_text_pipeline`]) as a
    `PromptEncoder`: `encode(pipeline, texts, max_sequence_length) -> (prompt_embeds, pooled_prompt_embeds)` is the
    family's call of its pipeline's `encode_prompt`; both are kept as float32 on the CPU. A family binds it with
    `functools.partial(load_prompt_encoder, text, encode)` (its `ModelFamily.load_prompt_encoder`)."""
    pipeline = load_text_pipeline(text, path, device)

    def encode_one(texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled = encode(pipeline, texts, settings.max_sequence_length)
        return {"prompt_embeds": embeds.float().cpu(), "pooled_prompt_embeds": pooled.float().cpu()}

    return functools.partial(encode_prompt_pairs, encode_one)
