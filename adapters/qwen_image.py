# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Qwen-Image: the velocity function over diffusers' `QwenImageTransformer2DModel`, and its adapters.

Inputs follow diffusers' `QwenImagePipeline` exactly: latents packed 2x2 into `(B, (h/2)(w/2), 4C)`,
`img_shapes = [[(1, h/2, w/2)]] * B`, `timestep / 1000`, `encoder_hidden_states_mask` from the prompt mask,
and true CFG `neg + s (cond - neg)` rescaled to the conditional prediction's norm along the channel dim
(`s`: the velocity's `guidance_scale`, `Trajectory.guidance_scale`; CFG when > 1).
What differs is precision: the latents are cast to the transformer's dtype only for the forward, the
prediction is cast to float32 before CFG and the scheduler, and nothing is stored in low precision.

Conditioning (batch-first):
    prompt_embeds (B, L, D) float32, prompt_embeds_mask (B, L) int64 (optional: absent = all valid),
    negative_prompt_embeds (B, L', D) float32 and negative_prompt_embeds_mask (B, L') int64 — required when
    guidance_scale > 1.

Family options (`Trajectory.family_options`, JSON):
    height, width (pixels; multiples of 2 * vae_scale_factor), vae_scale_factor (default 8),
    mask_text_padding (default True: pass the prompt mask to attention, as diffusers does; False: padded
    text keys are attended, as an attention kernel without a key-padding mask does).

Text RoPE: transformers that take `txt_seq_lens` get `padded_txt_seq_lens(prompt_embeds)` (rollout_consistency.adapters.rope).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor
from torch import nn

from rollout_consistency.schedulers import SchedulerSetup

from .entry_points import entry_points
from .families import (
    ModelFamily,
    PromptEncoder,
    check_float32_inputs,
    common_conditioning_keys,
    encode_prompt_pairs,
    load_pretrained_transformer,
    merged_options,
    model_dtype,
    register_family,
)
from .packing import pack_latents, packed_latent_grid
from .rope import (
    QwenImageTransformerTxtSeqLens,
    padded_txt_seq_lens,
    takes_txt_seq_lens,
)
from .settings import PipelineSettings

__all__ = [
    "FAMILY",
    "QWEN_IMAGE_SCHEDULER_CONFIG",
    "TEXT_KEYS",
    "collate_conditioning",
    "latent_grid",
    "pad_text_conditioning",
    "recompute_log_probs",
    "rollout",
    "velocity",
]

# (embeddings, mask) pairs of Qwen-Image conditioning.
TEXT_KEYS = (("prompt_embeds", "prompt_embeds_mask"), ("negative_prompt_embeds", "negative_prompt_embeds_mask"))
_DEFAULT_OPTIONS = {"vae_scale_factor": 8, "mask_text_padding": True}

# Qwen-Image's released scheduler config (FlowMatchEulerDiscreteScheduler, exponential dynamic shifting).
QWEN_IMAGE_SCHEDULER_CONFIG: Mapping[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "invert_sigmas": False,
    "shift_terminal": 0.02,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "time_shift_type": "exponential",
    "stochastic_sampling": False,
}


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    return merged_options(FAMILY, options)


def latent_grid(options: Mapping[str, Any]) -> tuple[int, int]:
    """Unpacked latent height and width `(h, w)` for an image of `height x width` pixels (both even)."""
    opts = _options(options)
    return packed_latent_grid(
        int(opts["height"]), int(opts["width"]), int(opts["vae_scale_factor"]), family_label="Qwen-Image"
    )


def _latent_shape(transformer: nn.Module, options: Mapping[str, Any]) -> tuple[int, int]:
    h, w = latent_grid(options)
    return ((h // 2) * (w // 2), int(transformer.config.in_channels))


def _initial_latents(
    transformer: nn.Module, generators: Sequence[torch.Generator], options: Mapping[str, Any]
) -> torch.Tensor:
    """Each sample's noise from its own CPU generator, in the unpacked `(1, 1, C, h, w)` shape that
    diffusers' `QwenImagePipeline.prepare_latents` draws, then packed."""
    h, w = latent_grid(options)
    channels = int(transformer.config.in_channels) // 4
    rows = [
        randn_tensor((1, 1, channels, h, w), generator=g, device=torch.device("cpu"), dtype=torch.float32)
        for g in generators
    ]
    return pack_latents(torch.cat(rows)[:, 0])


def _scheduler_setup(
    config: Mapping[str, Any], num_steps: int, transformer: nn.Module, options: Mapping[str, Any]
) -> SchedulerSetup:
    """`QwenImagePipeline`'s schedule: sigmas `linspace(1, 1/N, N)`, `mu` from the packed sequence length."""
    image_seq_len = _latent_shape(transformer, options)[0]
    return SchedulerSetup.for_pipeline(config, num_steps, image_seq_len)


def _check_text(transformer, conditioning, embeds_key, mask_key, batch) -> None:
    embeds = conditioning[embeds_key]
    if not isinstance(embeds, torch.Tensor) or embeds.dim() != 3:
        raise ValueError(f"{embeds_key} must be a (B, L, D) tensor, got {getattr(embeds, 'shape', embeds)!r}.")
    if embeds.dtype != torch.float32:
        raise TypeError(f"{embeds_key} is {embeds.dtype}; pass float32 embeddings (they are stored as given).")
    if embeds.shape[0] != batch:
        raise ValueError(
            f"{embeds_key} has {embeds.shape[0]} rows for {batch} samples (seeds); pass one row per sample."
        )
    width = int(transformer.config.joint_attention_dim)
    if embeds.shape[2] != width:
        raise ValueError(f"{embeds_key} has D={embeds.shape[2]} but the transformer's joint_attention_dim is {width}.")
    mask = conditioning.get(mask_key)
    if mask is None:
        return
    if mask.dtype != torch.int64:
        raise TypeError(f"{mask_key} is {mask.dtype}; pass an int64 mask (mask.long()), 1 = valid token.")
    if tuple(mask.shape) != tuple(embeds.shape[:2]):
        raise ValueError(
            f"{mask_key} has shape {tuple(mask.shape)} but {embeds_key} is {tuple(embeds.shape)}: the mask must be "
            f"(B, L) with the embeddings' length L = {embeds.shape[1]} (pad or trim both together)."
        )


def _check_conditioning(
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    batch: int,
    guidance_scale: float,
    options: Mapping[str, Any],
) -> None:
    latent_grid(options)
    if "prompt_embeds" not in conditioning:
        raise ValueError("Qwen-Image conditioning needs 'prompt_embeds' (B, L, D) float32 (and 'prompt_embeds_mask').")
    known = {k for pair in TEXT_KEYS for k in pair}
    unknown = set(conditioning) - known
    if unknown:
        raise ValueError(f"Unknown Qwen-Image conditioning keys {sorted(unknown)}; expected {sorted(known)}.")
    _check_text(transformer, conditioning, "prompt_embeds", "prompt_embeds_mask", batch)
    if guidance_scale > 1:
        if "negative_prompt_embeds" not in conditioning:
            raise ValueError(
                f"True CFG is on (guidance_scale={guidance_scale} > 1) but no negative prompt was given: pass "
                f"'negative_prompt_embeds' and 'negative_prompt_embeds_mask' (an empty negative prompt ' ' is fine), "
                f"or set guidance_scale <= 1."
            )
        _check_text(transformer, conditioning, "negative_prompt_embeds", "negative_prompt_embeds_mask", batch)
    elif "negative_prompt_embeds_mask" in conditioning and "negative_prompt_embeds" not in conditioning:
        raise ValueError("'negative_prompt_embeds_mask' given without 'negative_prompt_embeds'.")


def velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: Mapping[str, torch.Tensor],
    guidance_scale: float,
    *,
    options: Mapping[str, Any],
) -> torch.Tensor:
    """Qwen-Image velocity (noise_pred), float32.

    Args:
        transformer: `QwenImageTransformer2DModel` (or a subclass / vLLM-omni's, taking `txt_seq_lens`).
        latents (`torch.Tensor` `(B, seq, 4C)`, float32): packed latents.
        timesteps (`torch.Tensor` `(B,)`, float32): schedule values (0..1000).
        conditioning: see the module docstring. guidance_scale: true-CFG scale (CFG when > 1).
        options: family options (height, width, vae_scale_factor, mask_text_padding).

    Returns:
        `(B, seq, 4C)` float32.
    """
    opts = _options(options)
    check_float32_inputs(latents, timesteps)
    h, w = latent_grid(opts)
    batch = latents.shape[0]
    expected = _latent_shape(transformer, opts)
    if tuple(latents.shape[1:]) != expected:
        raise ValueError(
            f"Latents of per-sample shape {tuple(latents.shape[1:])} do not fit this Qwen-Image transformer at "
            f"{opts['height']}x{opts['width']} px: expected {expected} (packed (h/2)(w/2) tokens x in_channels)."
        )
    dtype = model_dtype(transformer)
    hidden_states = latents.to(dtype)  # the only low-precision copy, for this forward
    img_shapes = [[(1, h // 2, w // 2)]] * batch
    passes_lengths = takes_txt_seq_lens(transformer)

    def predict(embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        if mask is not None and bool(mask.all()):
            mask = None  # as QwenImagePipeline.encode_prompt: no padding, no mask (a different attention kernel)
        kwargs = dict(
            hidden_states=hidden_states,
            encoder_hidden_states=embeds.to(dtype),
            encoder_hidden_states_mask=mask if opts["mask_text_padding"] else None,
            timestep=timesteps / 1000,
            img_shapes=img_shapes,
            return_dict=False,
        )
        if passes_lengths:
            kwargs["txt_seq_lens"] = padded_txt_seq_lens(embeds)
        return transformer(**kwargs)[0].float()

    cond = predict(conditioning["prompt_embeds"], conditioning.get("prompt_embeds_mask"))
    if guidance_scale <= 1:
        return cond
    uncond = predict(conditioning["negative_prompt_embeds"], conditioning.get("negative_prompt_embeds_mask"))
    combined = uncond + guidance_scale * (cond - uncond)
    cond_norm = torch.norm(cond, dim=-1, keepdim=True)
    combined_norm = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / combined_norm)


def pad_text_conditioning(conditioning: Mapping[str, torch.Tensor], width: int) -> dict[str, torch.Tensor]:
    """Zero-pad every text embedding (and its mask, with 0) to `width` tokens.

    The padded rows are invisible under the key-padding mask; a transformer taking `txt_seq_lens` must then
    get `padded_txt_seq_lens` of the padded embeddings. ValueError if a text is already wider.
    """
    out = dict(conditioning)
    for embeds_key, mask_key in TEXT_KEYS:
        if embeds_key not in conditioning:
            continue
        embeds = conditioning[embeds_key]
        mask = conditioning.get(mask_key)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.int64, device=embeds.device)
        length = embeds.shape[1]
        if length > width:
            raise ValueError(f"{embeds_key} is {length} tokens wide, more than the target width {width}.")
        if length < width:
            embeds = torch.cat([embeds, embeds.new_zeros((embeds.shape[0], width - length, embeds.shape[2]))], dim=1)
            mask = torch.cat([mask, mask.new_zeros((mask.shape[0], width - length))], dim=1)
        out[embeds_key], out[mask_key] = embeds, mask
    return out


def collate_conditioning(
    conditionings: Sequence[Mapping[str, torch.Tensor]], width: int | None = None
) -> dict[str, torch.Tensor]:
    """Batch per-request Qwen-Image conditionings for one forward (the step-wise path).

    Each text (positive, negative) is zero-padded to `width`, or to the widest of the requests when `width` is
    None, then concatenated. Masks are created (all ones) for requests that had none.
    """
    keys = common_conditioning_keys(conditionings)
    out: dict[str, torch.Tensor] = {}
    for embeds_key, mask_key in TEXT_KEYS:
        if embeds_key not in keys:
            continue
        target = width if width is not None else max(c[embeds_key].shape[1] for c in conditionings)
        # One text at a time: the positive and negative texts each pad to their own target.
        padded = [
            pad_text_conditioning({k: c[k] for k in (embeds_key, mask_key) if k in c}, target) for c in conditionings
        ]
        out[embeds_key] = torch.cat([p[embeds_key] for p in padded])
        out[mask_key] = torch.cat([p[mask_key] for p in padded])
    return out


def _pipeline_options(settings: PipelineSettings) -> dict[str, Any]:
    return {"height": settings.height, "width": settings.width, "mask_text_padding": settings.mask_text_padding}


def _true_cfg_scale(settings: PipelineSettings) -> float:
    # Qwen-Image's only guidance is true CFG: the velocity's guidance_scale is it.
    return settings.true_cfg_scale


def _load_transformer(path, *, dtype: torch.dtype, device) -> QwenImageTransformerTxtSeqLens:
    return load_pretrained_transformer(QwenImageTransformerTxtSeqLens, path, dtype=dtype, device=device)


def _load_prompt_encoder(path, device, settings: PipelineSettings) -> PromptEncoder:
    """The checkpoint's own text encoder through diffusers' `QwenImagePipeline` (transformer/VAE not loaded)."""
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline.from_pretrained(path, transformer=None, vae=None).to(device)
    pad_to = settings.max_sequence_length if settings.pad_prompts_to_max_length else None

    def encode_one(texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, mask = pipeline.encode_prompt(texts, max_sequence_length=settings.max_sequence_length)
        if mask is None:  # diffusers drops an all-valid mask
            mask = torch.ones(embeds.shape[:2], dtype=torch.int64)
        return {"prompt_embeds": embeds.float().cpu(), "prompt_embeds_mask": mask.long().cpu()}

    def encode(prompts: Sequence[str], negative_prompts: Sequence[str] | None) -> dict[str, torch.Tensor]:
        out = encode_prompt_pairs(encode_one, prompts, negative_prompts)
        return out if pad_to is None else pad_text_conditioning(out, pad_to)

    return encode


FAMILY = register_family(
    ModelFamily(
        name="qwen-image",
        velocity=velocity,
        latent_shape=_latent_shape,
        initial_latents=_initial_latents,
        scheduler_setup=_scheduler_setup,
        check_conditioning=_check_conditioning,
        collate_conditioning=collate_conditioning,
        scheduler_config=QWEN_IMAGE_SCHEDULER_CONFIG,
        options=_pipeline_options,
        guidance=_true_cfg_scale,
        cfg_scale=_true_cfg_scale,
        negative_prompt=" ",
        load_transformer=_load_transformer,
        load_prompt_encoder=_load_prompt_encoder,
        default_options=_DEFAULT_OPTIONS,
        # Batch-first tensors and per-sample lists (img_shapes, txt_seq_lens): split by row in batch-invariant mode.
        row_inputs=frozenset(
            {
                "hidden_states",
                "encoder_hidden_states",
                "encoder_hidden_states_mask",
                "timestep",
                "img_shapes",
                "txt_seq_lens",
            }
        ),
    )
)


# The family's public entry points (their keywords: the module docstring; one implementation for all families).
rollout, recompute_log_probs = entry_points(FAMILY, __name__)
