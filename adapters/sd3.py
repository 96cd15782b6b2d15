# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Stable Diffusion 3: the velocity function over diffusers' `SD3Transformer2DModel`, and its adapters.

Inputs follow diffusers' `StableDiffusion3Pipeline`: latents `(B, C, h, w)` (SD3 patchifies inside the
transformer), `timestep` = the scheduler's value `σ·1000` as is, `pooled_projections` from the pooled
prompt embeddings, CFG `uncond + s (cond - uncond)` when `guidance_scale > 1` (`s`: the velocity's
`guidance_scale`, `Trajectory.guidance_scale`). What differs:

* precision: the latents are cast to the transformer's dtype only for the forward, the prediction is cast
  to float32 right after, CFG is combined in float32, nothing is stored in low precision;
* CFG runs as **two forwards of batch B** (conditional, then unconditional) where the pipeline runs one
  forward of batch 2B on `cat([uncond, cond])`. The conditional forward is then the same whether guidance
  is on or off, and a sample's prediction does not depend on its batch holding negative prompts. Rollout
  and recompute both go through this function, so they always agree on the choice; against a rollout
  engine that batches 2B, expect kernel-level differences only (tested: ≤ 1e-5 on the tiny model).

Conditioning (batch-first, float32; names as `StableDiffusion3Pipeline.encode_prompt` returns them):
    prompt_embeds (B, L, joint_attention_dim), pooled_prompt_embeds (B, pooled_projection_dim);
    negative_prompt_embeds (B, L', joint_attention_dim) and negative_pooled_prompt_embeds
    (B, pooled_projection_dim) — required when guidance_scale > 1.
SD3 takes no text mask: its encoders pad to a fixed length and the transformer attends to the padding, so
prompt embeddings must never be re-padded (see [`collate_conditioning`]).

Family options (`Trajectory.family_options`, JSON):
    height, width (pixels; multiples of vae_scale_factor · patch_size), vae_scale_factor (default 8).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor
from torch import nn

from rollout_consistency.schedulers import SchedulerSetup, image_seq_len_shift

from . import mmdit
from .entry_points import entry_points
from .families import (
    ModelFamily,
    check_float32_inputs,
    merged_options,
    model_dtype,
    register_family,
)
from .mmdit import TEXT_KEYS
from .settings import PipelineSettings

__all__ = [
    "FAMILY",
    "SD3_SCHEDULER_CONFIG",
    "TEXT_KEYS",
    "collate_conditioning",
    "latent_grid",
    "recompute_log_probs",
    "rollout",
    "velocity",
]

_TEXT = mmdit.MMDiTText(
    label="SD3",
    pipeline="StableDiffusion3Pipeline",
    transformer="SD3Transformer2DModel",
    cfg_name="guidance_scale",
    cfg_label="CFG",
)
_DEFAULT_OPTIONS = {"vae_scale_factor": 8}

# SD3 / SD3.5's released scheduler config (FlowMatchEulerDiscreteScheduler, static shift 3).
SD3_SCHEDULER_CONFIG: Mapping[str, Any] = {"num_train_timesteps": 1000, "shift": 3.0}


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    return merged_options(FAMILY, options)


def latent_grid(transformer: nn.Module, options: Mapping[str, Any]) -> tuple[int, int]:
    """Latent height and width `(h, w)` for an image of `height × width` pixels.

    Raises:
        ValueError: the size is not a positive multiple of `vae_scale_factor · patch_size` (the pipeline's
            rule), or it needs more patches than the transformer's `pos_embed_max_size`.
    """
    opts = _options(options)
    scale, patch = int(opts["vae_scale_factor"]), int(transformer.config.patch_size)
    height, width = int(opts["height"]), int(opts["width"])
    multiple = scale * patch
    if height % multiple or width % multiple or height <= 0 or width <= 0:
        raise ValueError(
            f"SD3 image size {height}x{width} must be positive multiples of vae_scale_factor * patch_size = {multiple}."
        )
    h, w = height // scale, width // scale
    max_patches = transformer.config.pos_embed_max_size
    if max_patches is not None and max(h, w) // patch > max_patches:
        raise ValueError(
            f"SD3 image size {height}x{width} is {h // patch}x{w // patch} patches; this transformer's "
            f"pos_embed_max_size is {max_patches}. Use a smaller image."
        )
    return h, w


def _latent_shape(transformer: nn.Module, options: Mapping[str, Any]) -> tuple[int, int, int]:
    h, w = latent_grid(transformer, options)
    return (int(transformer.config.in_channels), h, w)


def _initial_latents(
    transformer: nn.Module, generators: Sequence[torch.Generator], options: Mapping[str, Any]
) -> torch.Tensor:
    """Each sample's noise from its own CPU generator, `(1, C, h, w)` float32, as
    `StableDiffusion3Pipeline.prepare_latents` draws it with a list of generators."""
    shape = _latent_shape(transformer, options)
    return randn_tensor(
        (len(generators), *shape), generator=list(generators), device=torch.device("cpu"), dtype=torch.float32
    )


def _scheduler_setup(
    config: Mapping[str, Any], num_steps: int, transformer: nn.Module, options: Mapping[str, Any]
) -> SchedulerSetup:
    """`StableDiffusion3Pipeline`'s schedule: the scheduler's own sigmas for `num_steps`, plus `mu` from the
    image sequence length `(h/p)(w/p)` for a config with `use_dynamic_shifting` (SD3/SD3.5 use static shift)."""
    mu = None
    if config.get("use_dynamic_shifting"):
        h, w = latent_grid(transformer, options)
        patch = int(transformer.config.patch_size)
        mu = image_seq_len_shift((h // patch) * (w // patch), config)
    return SchedulerSetup(config=config, num_inference_steps=num_steps, mu=mu)


def _check_conditioning(
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    batch: int,
    guidance_scale: float,
    options: Mapping[str, Any],
) -> None:
    latent_grid(transformer, options)
    mmdit.check_text_conditioning(_TEXT, transformer, conditioning, batch, guidance_scale)


def velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: Mapping[str, torch.Tensor],
    guidance_scale: float,
    *,
    options: Mapping[str, Any],
) -> torch.Tensor:
    """SD3 velocity (noise_pred), float32.

    Args:
        transformer: `SD3Transformer2DModel`, any dtype.
        latents (`torch.Tensor` `(B, C, h, w)`, float32): the current sample.
        timesteps (`torch.Tensor` `(B,)`, float32): schedule values `σ·1000` (passed to the transformer as is).
        conditioning: see the module docstring. guidance_scale: CFG scale (CFG when > 1: two forwards).
        options: family options (height, width, vae_scale_factor).

    Returns:
        `(B, C, h, w)` float32; differentiable when grad is enabled.
    """
    check_float32_inputs(latents, timesteps)
    expected = _latent_shape(transformer, options)
    if latents.dim() != 4 or tuple(latents.shape[1:]) != expected:
        raise ValueError(
            f"Latents of shape {tuple(latents.shape)} do not fit this SD3 transformer at {options['height']}x"
            f"{options['width']} px: expected (B, {', '.join(map(str, expected))}) (in_channels x latent h x w)."
        )
    if timesteps.shape != (latents.shape[0],):
        raise ValueError(f"timesteps must be (B,) = ({latents.shape[0]},), got {tuple(timesteps.shape)}.")
    _check_conditioning(transformer, conditioning, latents.shape[0], guidance_scale, options)
    dtype = model_dtype(transformer)
    hidden_states = latents.to(dtype)  # the only low-precision copy, for this forward

    def predict(embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return transformer(
            hidden_states=hidden_states,
            encoder_hidden_states=embeds.to(dtype),
            pooled_projections=pooled.to(dtype),
            timestep=timesteps,
            return_dict=False,
        )[0].float()

    return mmdit.guided_prediction(predict, conditioning, guidance_scale)


def collate_conditioning(
    conditionings: Sequence[Mapping[str, torch.Tensor]], width: int | None = None
) -> dict[str, torch.Tensor]:
    """Batch per-request SD3 conditionings for one forward (the step-wise path): concatenation, no padding
    (`rollout_consistency.adapters.mmdit.collate_text_conditioning`)."""
    return mmdit.collate_text_conditioning(_TEXT, conditionings, width)


def _pipeline_options(settings: PipelineSettings) -> dict[str, Any]:
    return {"height": settings.height, "width": settings.width}


def _guidance_scale(settings: PipelineSettings) -> float:
    # SD3: the velocity takes the pipeline's guidance_scale (its CFG scale).
    return settings.guidance_scale


def _cfg_scale(settings: PipelineSettings) -> float:
    return settings.guidance_scale


def _encode_prompt(pipeline: Any, texts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`StableDiffusion3Pipeline.encode_prompt` of `texts` (no CFG): `(prompt_embeds, pooled_prompt_embeds)`
    (`mmdit.load_prompt_encoder`)."""
    embeds, _, pooled, _ = pipeline.encode_prompt(
        texts, None, None, do_classifier_free_guidance=False, max_sequence_length=max_sequence_length
    )
    return embeds, pooled


FAMILY = register_family(
    ModelFamily(
        name="sd3",
        velocity=velocity,
        latent_shape=_latent_shape,
        initial_latents=_initial_latents,
        scheduler_setup=_scheduler_setup,
        check_conditioning=_check_conditioning,
        collate_conditioning=collate_conditioning,
        scheduler_config=SD3_SCHEDULER_CONFIG,
        options=_pipeline_options,
        guidance=_guidance_scale,
        cfg_scale=_cfg_scale,
        negative_prompt="",
        load_transformer=functools.partial(mmdit.load_transformer, _TEXT),
        load_prompt_encoder=functools.partial(mmdit.load_prompt_encoder, _TEXT, _encode_prompt),
        default_options=_DEFAULT_OPTIONS,
        row_inputs=frozenset({"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"}),
    )
)


# The family's public entry points (their keywords: the module docstring; one implementation for all families).
rollout, recompute_log_probs = entry_points(FAMILY, __name__)
