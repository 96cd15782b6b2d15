# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""FLUX: the velocity function over diffusers' `FluxTransformer2DModel`, and its adapters.

Inputs follow diffusers' `FluxPipeline` exactly: latents packed 2x2 into `(B, (h/2)(w/2), 4C)` (the same
packing as Qwen-Image), `img_ids` = `FluxPipeline._prepare_latent_image_ids`, `txt_ids` zeros `(L, 3)`
for the width `L` of the embeddings passed, `timestep / 1000`, `pooled_projections` from the pooled
prompt embeddings, and for guidance-distilled checkpoints (`guidance_embeds=True`, FLUX.1-dev) the
embedded `guidance` tensor filled with `guidance_scale`. True CFG (`true_cfg_scale > 1`) is a second
forward on the negative prompt, `neg + s (cond - neg)`, as `FluxPipeline` runs it. What differs is
precision: the latents are cast to the transformer's dtype only for the forward (the pipeline also
rounds the timestep to the latents' dtype first; here it stays float32 until the transformer's own cast),
the prediction is cast to float32 before true CFG and the scheduler, and nothing is stored in low
precision. `img_ids` and `txt_ids` are float32 (the transformer reads them with `.float()`).

`guidance_scale` (and `Trajectory.guidance_scale`) is the **embedded** guidance, as `FluxPipeline`'s
argument of that name (`FluxPipeline` uses 3.5; `SamplingSettings` defaults to 1.0, so pass it); a model
without `guidance_embeds` (FLUX.1-schnell) ignores it, as the pipeline does. `true_cfg_scale` is a family option.

Conditioning (batch-first, float32; names as `FluxPipeline.encode_prompt` returns them):
    prompt_embeds (B, L, joint_attention_dim), pooled_prompt_embeds (B, pooled_projection_dim);
    negative_prompt_embeds (B, L', joint_attention_dim) and negative_pooled_prompt_embeds
    (B, pooled_projection_dim) — required when true_cfg_scale > 1.
FLUX takes no text mask (T5 pads to max_sequence_length and the transformer attends to the padding), so
prompt embeddings must never be re-padded (see [`collate_conditioning`]).

Family options (`Trajectory.family_options`, JSON):
    height, width (pixels; multiples of 2 · vae_scale_factor), vae_scale_factor (default 8),
    true_cfg_scale (default 1.0: off).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor
from torch import nn

from rollout_consistency.schedulers import SchedulerSetup

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
from .packing import pack_latents, packed_latent_grid, unpack_latents
from .settings import PipelineSettings

__all__ = [
    "FAMILY",
    "FLUX_SCHEDULER_CONFIG",
    "TEXT_KEYS",
    "collate_conditioning",
    "latent_grid",
    "latent_image_ids",
    "pack_latents",
    "recompute_log_probs",
    "rollout",
    "unpack_latents",
    "velocity",
]

_TEXT = mmdit.MMDiTText(
    label="FLUX",
    pipeline="FluxPipeline",
    transformer="FluxTransformer2DModel",
    cfg_name="true_cfg_scale",
    cfg_label="True CFG",
    cfg_hint=" (the embedded guidance_scale of guidance-distilled FLUX needs no negative prompt)",
)
_DEFAULT_OPTIONS = {"vae_scale_factor": 8, "true_cfg_scale": 1.0}

# FLUX.1's released scheduler config (FlowMatchEulerDiscreteScheduler, dynamic shifting).
FLUX_SCHEDULER_CONFIG: Mapping[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    return merged_options(FAMILY, options)


def latent_grid(options: Mapping[str, Any]) -> tuple[int, int]:
    """Unpacked latent height and width `(h, w)` for an image of `height × width` pixels (both even).

    Raises:
        ValueError: the size is not a positive multiple of `2 · vae_scale_factor`. (`FluxPipeline` floors
            such a size with a warning; a silently resized rollout would not match its trainer, so it is refused.)
    """
    opts = _options(options)
    return packed_latent_grid(
        int(opts["height"]), int(opts["width"]), int(opts["vae_scale_factor"]), family_label="FLUX"
    )


def latent_image_ids(h: int, w: int, device: torch.device | str | None = None) -> torch.Tensor:
    """`img_ids` `(h/2 · w/2, 3)` float32 for an unpacked `h × w` latent, as `FluxPipeline._prepare_latent_image_ids`."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] = ids[..., 1] + torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3)


def _latent_shape(transformer: nn.Module, options: Mapping[str, Any]) -> tuple[int, int]:
    h, w = latent_grid(options)
    return ((h // 2) * (w // 2), int(transformer.config.in_channels))


def _initial_latents(
    transformer: nn.Module, generators: Sequence[torch.Generator], options: Mapping[str, Any]
) -> torch.Tensor:
    """Each sample's noise from its own CPU generator in the unpacked `(1, C, h, w)` shape that
    `FluxPipeline.prepare_latents` draws, then packed."""
    h, w = latent_grid(options)
    channels = int(transformer.config.in_channels) // 4
    noise = randn_tensor(
        (len(generators), channels, h, w), generator=list(generators), device=torch.device("cpu"), dtype=torch.float32
    )
    return pack_latents(noise)


def _scheduler_setup(
    config: Mapping[str, Any], num_steps: int, transformer: nn.Module, options: Mapping[str, Any]
) -> SchedulerSetup:
    """`FluxPipeline`'s schedule: sigmas `linspace(1, 1/N, N)`, `mu` from the packed sequence length."""
    return SchedulerSetup.for_pipeline(config, num_steps, _latent_shape(transformer, options)[0])


def _check_conditioning(
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    batch: int,
    guidance_scale: float,
    options: Mapping[str, Any],
) -> None:
    opts = _options(options)
    latent_grid(opts)
    if int(transformer.config.patch_size) != 1:
        raise ValueError(
            f"This FLUX transformer has patch_size={transformer.config.patch_size}; FluxPipeline's 2x2 packing "
            f"(and this adapter) assume patch_size=1."
        )
    mmdit.check_text_conditioning(_TEXT, transformer, conditioning, batch, float(opts["true_cfg_scale"]))


def velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: Mapping[str, torch.Tensor],
    guidance_scale: float,
    *,
    options: Mapping[str, Any],
) -> torch.Tensor:
    """FLUX velocity (noise_pred), float32.

    Args:
        transformer: `FluxTransformer2DModel` (patch_size 1), any dtype.
        latents (`torch.Tensor` `(B, (h/2)(w/2), 4C)`, float32): packed latents.
        timesteps (`torch.Tensor` `(B,)`, float32): schedule values (0..1000); passed as `timesteps / 1000`.
        conditioning: see the module docstring.
        guidance_scale: embedded guidance (models with `guidance_embeds`); ignored otherwise.
        options: family options (height, width, vae_scale_factor, true_cfg_scale).

    Returns:
        `(B, (h/2)(w/2), 4C)` float32; differentiable when grad is enabled.
    """
    opts = _options(options)
    check_float32_inputs(latents, timesteps)
    h, w = latent_grid(opts)
    batch = latents.shape[0]
    expected = _latent_shape(transformer, opts)
    if latents.dim() != 3 or tuple(latents.shape[1:]) != expected:
        hint = (
            " (unpacked latents? pack them with rollout_consistency.adapters.flux.pack_latents)"
            if latents.dim() == 4
            else ""
        )
        raise ValueError(
            f"Latents of shape {tuple(latents.shape)} do not fit this FLUX transformer at {opts['height']}x"
            f"{opts['width']} px: expected (B, {expected[0]}, {expected[1]}) (packed (h/2)(w/2) tokens x "
            f"in_channels){hint}."
        )
    if timesteps.shape != (batch,):
        raise ValueError(f"timesteps must be (B,) = ({batch},), got {tuple(timesteps.shape)}.")
    _check_conditioning(transformer, conditioning, batch, guidance_scale, opts)
    dtype = model_dtype(transformer)
    hidden_states = latents.to(dtype)  # the only low-precision copy, for this forward
    img_ids = latent_image_ids(h, w, device=latents.device)
    guidance = None
    if transformer.config.guidance_embeds:
        guidance = torch.full((batch,), float(guidance_scale), dtype=torch.float32, device=latents.device)

    def predict(embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        return transformer(
            hidden_states=hidden_states,
            encoder_hidden_states=embeds.to(dtype),
            pooled_projections=pooled.to(dtype),
            timestep=timesteps / 1000,
            guidance=guidance,
            img_ids=img_ids,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=latents.device),
            return_dict=False,
        )[0].float()

    return mmdit.guided_prediction(predict, conditioning, float(opts["true_cfg_scale"]))


def collate_conditioning(
    conditionings: Sequence[Mapping[str, torch.Tensor]], width: int | None = None
) -> dict[str, torch.Tensor]:
    """Batch per-request FLUX conditionings for one forward (the step-wise path): concatenation, no padding
    (`rollout_consistency.adapters.mmdit.collate_text_conditioning`)."""
    return mmdit.collate_text_conditioning(_TEXT, conditionings, width)


def _pipeline_options(settings: PipelineSettings) -> dict[str, Any]:
    return {"height": settings.height, "width": settings.width, "true_cfg_scale": settings.true_cfg_scale}


def _guidance_scale(settings: PipelineSettings) -> float:
    # FLUX: the velocity takes the pipeline's guidance_scale (the embedded guidance).
    return settings.guidance_scale


def _cfg_scale(settings: PipelineSettings) -> float:
    return settings.true_cfg_scale


def _encode_prompt(pipeline: Any, texts: list[str], max_sequence_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`FluxPipeline.encode_prompt` of `texts`: `(prompt_embeds, pooled_prompt_embeds)` (`mmdit.load_prompt_encoder`)."""
    embeds, pooled, _ = pipeline.encode_prompt(texts, None, max_sequence_length=max_sequence_length)
    return embeds, pooled


FAMILY = register_family(
    ModelFamily(
        name="flux",
        velocity=velocity,
        latent_shape=_latent_shape,
        initial_latents=_initial_latents,
        scheduler_setup=_scheduler_setup,
        check_conditioning=_check_conditioning,
        collate_conditioning=collate_conditioning,
        scheduler_config=FLUX_SCHEDULER_CONFIG,
        options=_pipeline_options,
        guidance=_guidance_scale,
        cfg_scale=_cfg_scale,
        negative_prompt="",
        load_transformer=functools.partial(mmdit.load_transformer, _TEXT),
        load_prompt_encoder=functools.partial(mmdit.load_prompt_encoder, _TEXT, _encode_prompt),
        default_options=_DEFAULT_OPTIONS,
        # Batch-first (or per-sample) transformer inputs; img_ids / txt_ids are shared by all rows.
        row_inputs=frozenset({"hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"}),
    )
)


# The family's public entry points (their keywords: the module docstring; one implementation for all families).
rollout, recompute_log_probs = entry_points(FAMILY, __name__)
