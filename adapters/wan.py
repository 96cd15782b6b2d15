# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Wan 2.x (text to video): the velocity function over diffusers' `WanTransformer3DModel`, Wan 2.2's two experts,
and the family's adapters.

Inputs follow diffusers' `WanPipeline` exactly: video latents `(B, C, F, h, w)` as they are (Wan patchifies
`(1, 2, 2)` and builds its 3-D RoPE inside the transformer, from the latent grid), `timestep` = the scheduler's
value `σ·1000` as is, `encoder_hidden_states` = the UMT5 prompt embeddings zero-padded to a fixed length (no text
mask: the transformer attends to every token), CFG `uncond + s (cond − uncond)` from two forwards of batch B when
`guidance_scale > 1`. What differs is precision: the latents are cast to the transformer's dtype only for the
forward, the prediction is cast to float32 right after, CFG is combined in float32, nothing is stored in low
precision.

**Two experts (Wan 2.2 A14B).** `WanPipeline(transformer=..., transformer_2=..., boundary_ratio=r)` denoises the
steps whose timestep is `t >= r · num_train_timesteps` with `transformer` (high noise) and the steps below with
`transformer_2` (low noise), each with its own CFG scale (`guidance_scale`, `guidance_scale_2`). Here both experts
travel as one module, [`WanExperts`]: `expert_names(timesteps)` says which expert each row's timestep takes (the
pipeline's comparison, in float32), the velocity asks it once per forward and uses the answer for the dispatch
and for the CFG scale, and the rollout and the trainer record it (`Trajectory.experts`; the checker's
`experts` guard compares both sides' records step by step). A plain `WanTransformer3DModel` (Wan 2.1, Wan 2.2
TI2V-5B) is the one expert `transformer` for every step.

Conditioning (batch-first, float32; names as `WanPipeline.encode_prompt` returns them):
    prompt_embeds (B, L, text_dim); negative_prompt_embeds (B, L', text_dim) — required when guidance_scale > 1.
Wan takes no text mask, so prompt embeddings must never be re-padded (see [`collate_conditioning`]).

Family options (`Trajectory.family_options`, JSON):
    height, width (pixels; multiples of vae_scale_factor_spatial · patch size), num_frames (`(num_frames − 1)`
    a multiple of vae_scale_factor_temporal), vae_scale_factor_spatial (default 8), vae_scale_factor_temporal
    (default 4), guidance_scale_2 (the low-noise expert's CFG scale; default None: the same as guidance_scale),
    expand_timesteps (default False; Wan 2.2 TI2V-5B's per-token timestep, as `WanPipeline(expand_timesteps=True)`).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor
from torch import nn

from rollout_consistency.schedulers import SchedulerSetup, image_seq_len_shift

from .entry_points import entry_points
from .families import (
    ModelFamily,
    PromptEncoder,
    check_float32_inputs,
    concat_fixed_width_conditioning,
    encode_prompt_pairs,
    load_pretrained_transformer,
    model_dtype,
    register_family,
)
from .settings import PipelineSettings

__all__ = [
    "EXPERT_NAMES",
    "FAMILY",
    "TEXT_KEYS",
    "WAN_SCHEDULER_CONFIG",
    "WanExperts",
    "collate_conditioning",
    "expert_names",
    "latent_grid",
    "recompute_log_probs",
    "rollout",
    "velocity",
]

TEXT_KEYS = ("prompt_embeds", "negative_prompt_embeds")
#: The experts' names, as `WanPipeline`'s components and `Trajectory.experts` call them (high noise, low noise).
EXPERT_NAMES = ("transformer", "transformer_2")
_DEFAULT_OPTIONS = {  # WanPipeline's defaults
    "num_frames": 81,
    "vae_scale_factor_spatial": 8,
    "vae_scale_factor_temporal": 4,
    "guidance_scale_2": None,
    "expand_timesteps": False,
}

#: The flow-matching schedule RL trainers sample Wan with: FlowMatchEulerDiscreteScheduler with a static shift of
#: 5.0 (the shift DanceGRPO-style Wan 2.2 training uses). The released diffusers directories ship a UniPC
#: multistep config; its `flow_shift` is read as this `shift` (see `_flow_match_config`).
WAN_SCHEDULER_CONFIG: Mapping[str, Any] = {"num_train_timesteps": 1000, "shift": 5.0}
# The FlowMatchEulerDiscreteScheduler settings a Wan scheduler config may carry; the rest (UniPC's solver order,
# prediction type, ...) describe another sampler and are dropped.
_FLOW_MATCH_KEYS = (
    "num_train_timesteps",
    "shift",
    "use_dynamic_shifting",
    "base_shift",
    "max_shift",
    "base_image_seq_len",
    "max_image_seq_len",
    "invert_sigmas",
    "shift_terminal",
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "time_shift_type",
    "stochastic_sampling",
)


class WanExperts(nn.Module):
    """Wan 2.2's two experts as one module: `transformer` for timesteps `>= boundary_ratio · num_train_timesteps`,
    `transformer_2` below (diffusers' `WanPipeline` comparison, in float32).

    Its forward takes a `WanTransformer3DModel`'s keyword inputs plus `experts` (one name per row, from
    [`expert_names`]; computed from `timestep` when omitted) and gives each row its expert's output: one forward
    when every row takes the same expert (the pipeline's case); for a batch across the boundary (a step-wise
    batch, a trainer micro-batch of rows at different steps) each expert runs on the *whole* batch and each row
    is taken from its own expert's output. That costs one forward more, and keeps every row's forward a forward
    of the batch it came in: a row's bits do not depend on how its batch-mates split between the experts (the
    same rows as sub-batches would take other kernels). `config` is the first expert's (both share the
    architecture).

    Args:
        transformer: the high-noise expert. transformer_2: the low-noise expert.
        boundary_ratio: the switch, as a fraction of `num_train_timesteps` (Wan2.2-T2V-A14B: 0.875).
        num_train_timesteps: the scheduler's (1000).
    """

    def __init__(
        self,
        transformer: nn.Module,
        transformer_2: nn.Module,
        boundary_ratio: float,
        *,
        num_train_timesteps: int = 1000,
    ):
        super().__init__()
        if not (isinstance(boundary_ratio, (int, float)) and 0 <= boundary_ratio <= 1):
            raise ValueError(f"boundary_ratio must be a number in [0, 1], got {boundary_ratio!r}.")
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_ratio = float(boundary_ratio)
        self.num_train_timesteps = int(num_train_timesteps)

    @property
    def config(self) -> Any:
        return self.transformer.config

    @property
    def boundary_timestep(self) -> float:
        """`boundary_ratio · num_train_timesteps`, as `WanPipeline` computes it."""
        return self.boundary_ratio * self.num_train_timesteps

    def expert_names(self, timesteps: torch.Tensor) -> tuple[str, ...]:
        """The expert of each row's timestep `(B,)`: `"transformer"` where `t >= boundary_timestep`, else
        `"transformer_2"`."""
        high = (timesteps.reshape(len(timesteps), -1)[:, 0] >= self.boundary_timestep).tolist()
        return tuple(EXPERT_NAMES[0] if h else EXPERT_NAMES[1] for h in high)

    def forward(self, *, timestep: torch.Tensor, experts: Sequence[str] | None = None, **inputs: Any) -> Any:
        names = tuple(experts) if experts is not None else self.expert_names(timestep)
        unknown = set(names) - set(EXPERT_NAMES)
        if unknown:
            raise ValueError(f"Unknown Wan expert(s) {sorted(unknown)}; expected {', '.join(EXPERT_NAMES)}.")
        if len(set(names)) == 1:
            return getattr(self, names[0])(timestep=timestep, **inputs)
        return _forward_by_expert(self, names, timestep, inputs)


def _forward_by_expert(experts: WanExperts, names: Sequence[str], timestep: torch.Tensor, inputs: Mapping) -> Any:
    """A batch across the boundary: every expert on the whole batch, each row from its own expert (tuple output)."""
    out: torch.Tensor | None = None
    for name in EXPERT_NAMES:
        rows = [b for b, n in enumerate(names) if n == name]
        if not rows:
            continue
        sample = getattr(experts, name)(timestep=timestep, **{**inputs, "return_dict": False})[0]
        index = torch.tensor(rows, device=sample.device)
        if out is None:
            out = torch.empty_like(sample)
        out[index] = sample[index]
    return (out,)


def expert_names(transformer: nn.Module, timesteps: torch.Tensor) -> tuple[str, ...]:
    """The expert each row's timestep `(B,)` takes on `transformer`: a [`WanExperts`] (or a wrapper of one, or its
    batch-invariant proxy) answers for itself; a single `WanTransformer3DModel` is `"transformer"` for every step,
    as in `WanPipeline` without `transformer_2`."""
    choose = getattr(transformer, "expert_names", None)
    return (EXPERT_NAMES[0],) * len(timesteps) if choose is None else tuple(choose(timesteps))


def _has_experts(transformer: nn.Module) -> bool:
    return getattr(transformer, "expert_names", None) is not None


def _options(options: Mapping[str, Any]) -> dict[str, Any]:
    merged = {**_DEFAULT_OPTIONS, **dict(options)}
    for key in ("height", "width"):
        if key not in merged:
            raise ValueError(f"Wan options need {key!r} (video size in pixels).")
    return merged


def latent_grid(transformer: nn.Module, options: Mapping[str, Any]) -> tuple[int, int, int]:
    """Latent frames, height and width `(F, h, w)` of a `num_frames × height × width` video.

    Raises:
        ValueError: a size the pipeline would round (height/width not multiples of `vae_scale_factor_spatial ·
            patch_size`, `num_frames − 1` not a multiple of `vae_scale_factor_temporal`: `WanPipeline` rounds
            with a warning, and a silently resized rollout would not match its trainer), or a latent grid longer
            than the transformer's RoPE table (`rope_max_seq_len`) along an axis.
    """
    opts = _options(options)
    spatial, temporal = int(opts["vae_scale_factor_spatial"]), int(opts["vae_scale_factor_temporal"])
    p_t, p_h, p_w = (int(p) for p in transformer.config.patch_size)
    height, width, frames = int(opts["height"]), int(opts["width"]), int(opts["num_frames"])
    if height <= 0 or width <= 0 or height % (spatial * p_h) or width % (spatial * p_w):
        raise ValueError(
            f"Wan video size {height}x{width} must be positive multiples of vae_scale_factor_spatial * patch_size = "
            f"{spatial * p_h}x{spatial * p_w} (WanPipeline would round it)."
        )
    if frames < 1 or (frames - 1) % temporal:
        raise ValueError(
            f"Wan num_frames {frames}: num_frames - 1 must be a multiple of vae_scale_factor_temporal = {temporal} "
            f"(e.g. {(frames - 1) // temporal * temporal + 1} or {((frames - 1) // temporal + 1) * temporal + 1}; "
            f"WanPipeline would round it)."
        )
    grid = ((frames - 1) // temporal + 1, height // spatial, width // spatial)
    if grid[0] % p_t:
        raise ValueError(f"Wan latent frames {grid[0]} are not a multiple of the temporal patch size {p_t}.")
    rope_length = int(transformer.config.rope_max_seq_len)
    patches = (grid[0] // p_t, grid[1] // p_h, grid[2] // p_w)
    if max(patches) > rope_length:
        raise ValueError(
            f"Wan video {frames}x{height}x{width} is {patches[0]}x{patches[1]}x{patches[2]} patches; this "
            f"transformer's RoPE table holds {rope_length} positions per axis (rope_max_seq_len). Use a smaller video."
        )
    return grid


def _latent_shape(transformer: nn.Module, options: Mapping[str, Any]) -> tuple[int, int, int, int]:
    return (int(transformer.config.in_channels), *latent_grid(transformer, options))


def _initial_latents(
    transformer: nn.Module, generators: Sequence[torch.Generator], options: Mapping[str, Any]
) -> torch.Tensor:
    """Each sample's noise from its own CPU generator, `(1, C, F, h, w)` float32, as `WanPipeline.prepare_latents`
    draws it with a list of generators."""
    shape = _latent_shape(transformer, options)
    return randn_tensor(
        (len(generators), *shape), generator=list(generators), device=torch.device("cpu"), dtype=torch.float32
    )


def _flow_match_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A Wan scheduler config as FlowMatchEulerDiscreteScheduler settings: a UniPC config's `flow_shift` becomes
    `shift` (the same time shift), keys of other samplers are dropped."""
    out = {k: v for k, v in config.items() if k in _FLOW_MATCH_KEYS}
    if "shift" not in out and "flow_shift" in config:
        out["shift"] = float(config["flow_shift"])
    return out


def _scheduler_setup(
    config: Mapping[str, Any], num_steps: int, transformer: nn.Module, options: Mapping[str, Any]
) -> SchedulerSetup:
    """`WanPipeline`'s schedule: `set_timesteps(num_steps)` on the scheduler's own sigmas (`mu` from the video's
    token count only for a config with `use_dynamic_shifting`)."""
    config = _flow_match_config(config)
    mu = None
    if config.get("use_dynamic_shifting"):
        grid = latent_grid(transformer, options)
        p_t, p_h, p_w = (int(p) for p in transformer.config.patch_size)
        mu = image_seq_len_shift((grid[0] // p_t) * (grid[1] // p_h) * (grid[2] // p_w), config)
    return SchedulerSetup(config=config, num_inference_steps=num_steps, mu=mu)


def _check_text(transformer: nn.Module, conditioning: Mapping[str, torch.Tensor], key: str, batch: int) -> None:
    tensor = conditioning.get(key)
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
        raise ValueError(f"Wan {key} must be a (B, L, text_dim) tensor, got {getattr(tensor, 'shape', tensor)!r}.")
    if tensor.dtype != torch.float32:
        raise TypeError(f"Wan {key} is {tensor.dtype}; pass float32 embeddings (they are stored as given).")
    if tensor.shape[0] != batch:
        raise ValueError(f"Wan {key} has {tensor.shape[0]} rows for {batch} samples (seeds); pass one row per sample.")
    width = int(transformer.config.text_dim)
    if tensor.shape[2] != width:
        raise ValueError(f"Wan {key} has width {tensor.shape[2]} but this transformer's text_dim is {width}.")


def _check_conditioning(
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    batch: int,
    guidance_scale: float,
    options: Mapping[str, Any],
) -> None:
    latent_grid(transformer, options)
    unknown = set(conditioning) - set(TEXT_KEYS)
    if unknown:
        raise ValueError(
            f"Unknown Wan conditioning keys {sorted(unknown)}; expected {list(TEXT_KEYS)} (Wan takes no text mask: "
            f"UMT5 embeddings are zero-padded to a fixed length and the transformer attends to every token)."
        )
    if TEXT_KEYS[0] not in conditioning:
        raise ValueError("Wan conditioning needs 'prompt_embeds' (B, L, text_dim) float32.")
    _check_text(transformer, conditioning, TEXT_KEYS[0], batch)
    if guidance_scale > 1:
        if TEXT_KEYS[1] not in conditioning:
            raise ValueError(
                f"CFG is on (guidance_scale={guidance_scale} > 1) but no negative prompt was given: pass "
                f"'negative_prompt_embeds' (encode_prompt of the negative prompt; an empty string is WanPipeline's "
                f"default), or set guidance_scale <= 1."
            )
        _check_text(transformer, conditioning, TEXT_KEYS[1], batch)
    guidance_scale_2 = _options(options)["guidance_scale_2"]
    if guidance_scale_2 is not None and not math.isfinite(float(guidance_scale_2)):
        raise ValueError(f"Wan guidance_scale_2 must be finite or None, got {guidance_scale_2!r}.")


def velocity(
    transformer: nn.Module,
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    conditioning: Mapping[str, torch.Tensor],
    guidance_scale: float,
    *,
    options: Mapping[str, Any],
) -> torch.Tensor:
    """Wan velocity (noise_pred), float32.

    Args:
        transformer: `WanTransformer3DModel`, or [`WanExperts`] (Wan 2.2's two experts), any dtype.
        latents (`torch.Tensor` `(B, C, F, h, w)`, float32): the current video latents.
        timesteps (`torch.Tensor` `(B,)`, float32): schedule values `σ·1000` (passed to the transformer as is;
            expanded to one per video token with `expand_timesteps`).
        conditioning: see the module docstring.
        guidance_scale: CFG scale of the high-noise expert (CFG when > 1: two forwards); the low-noise expert
            uses `options["guidance_scale_2"]` (default: the same), as `WanPipeline` does.
        options: family options (height, width, num_frames, vae scale factors, guidance_scale_2, expand_timesteps).

    Returns:
        `(B, C, F, h, w)` float32; differentiable when grad is enabled.
    """
    opts = _options(options)
    check_float32_inputs(latents, timesteps)
    expected = _latent_shape(transformer, opts)
    batch = latents.shape[0]
    if latents.dim() != 5 or tuple(latents.shape[1:]) != expected:
        raise ValueError(
            f"Latents of shape {tuple(latents.shape)} do not fit this Wan transformer at {opts['num_frames']} frames "
            f"of {opts['height']}x{opts['width']} px: expected (B, {', '.join(map(str, expected))}) (in_channels x "
            f"latent frames x h x w)."
        )
    if timesteps.shape != (batch,):
        raise ValueError(f"timesteps must be (B,) = ({batch},), got {tuple(timesteps.shape)}.")
    _check_conditioning(transformer, conditioning, batch, guidance_scale, opts)
    dtype = model_dtype(transformer)
    hidden_states = latents.to(dtype)  # the only low-precision copy, for this forward
    timestep = timesteps
    if opts["expand_timesteps"]:
        # WanPipeline(expand_timesteps=True) on a text-to-video request: its all-ones mask times t, one per token
        # of the (frames, h/2, w/2) grid (the pipeline subsamples the mask by 2 whatever the patch size).
        frames, h, w = expected[1:]
        tokens = frames * math.ceil(h / 2) * math.ceil(w / 2)
        timestep = timesteps[:, None].expand(batch, tokens)
    names = expert_names(transformer, timesteps)
    extra = {"experts": list(names)} if _has_experts(transformer) else {}

    def predict(embeds: torch.Tensor) -> torch.Tensor:
        return transformer(
            hidden_states=hidden_states,
            timestep=timestep,
            encoder_hidden_states=embeds.to(dtype),
            return_dict=False,
            **extra,
        )[0].float()

    cond = predict(conditioning["prompt_embeds"])
    if guidance_scale <= 1:  # WanPipeline: CFG is on when guidance_scale > 1, whatever guidance_scale_2 is
        return cond
    uncond = predict(conditioning["negative_prompt_embeds"])
    scale_2 = guidance_scale if opts["guidance_scale_2"] is None else float(opts["guidance_scale_2"])
    if set(names) == {EXPERT_NAMES[0]}:
        return uncond + guidance_scale * (cond - uncond)
    if set(names) == {EXPERT_NAMES[1]}:
        return uncond + scale_2 * (cond - uncond)
    # A batch across the boundary: each row with its expert's scale (elementwise, so each row's bits are those of
    # a batch of its own expert).
    guided = torch.empty_like(cond)
    for name, scale in zip(EXPERT_NAMES, (guidance_scale, scale_2), strict=True):
        rows = torch.tensor([b for b, n in enumerate(names) if n == name], device=cond.device)
        guided[rows] = uncond[rows] + scale * (cond[rows] - uncond[rows])
    return guided


def collate_conditioning(
    conditionings: Sequence[Mapping[str, torch.Tensor]], width: int | None = None
) -> dict[str, torch.Tensor]:
    """Batch per-request Wan conditionings for one forward (the step-wise path): concatenation, no padding.

    Wan has no text mask, so requests must share one text width; see
    `rollout_consistency.adapters.families.concat_fixed_width_conditioning`.
    """
    return concat_fixed_width_conditioning(conditionings, width, text_keys=TEXT_KEYS, pipeline="WanPipeline")


def _experts(transformer: nn.Module, timesteps: torch.Tensor, options: Mapping[str, Any]) -> tuple[str, ...]:
    return expert_names(transformer, timesteps)


def _pipeline_options(settings: PipelineSettings) -> dict[str, Any]:
    return {
        "height": settings.height,
        "width": settings.width,
        "num_frames": settings.num_frames,
        "guidance_scale_2": settings.guidance_scale_2,
    }


def _guidance_scale(settings: PipelineSettings) -> float:
    # Wan: the velocity takes the pipeline's guidance_scale (its CFG scale; guidance_scale_2 is a family option).
    return settings.guidance_scale


def _model_kwargs(settings: PipelineSettings) -> dict[str, Any]:
    return {"boundary_ratio": settings.boundary_ratio}


def _read_boundary_ratio(path: Path) -> float | None:
    index = path / "model_index.json"
    if not index.is_file():
        return None
    value = json.loads(index.read_text()).get("boundary_ratio")
    return None if value is None else float(value)


def load_transformer(
    path: str | os.PathLike, *, dtype: torch.dtype, device: Any, boundary_ratio: float | None = None
) -> nn.Module:
    """A Wan model directory's transformer, or its two experts as [`WanExperts`] when the directory holds a
    `transformer_2/` (Wan 2.2 A14B), switching at `boundary_ratio` (default: the directory's `model_index.json`).

    Raises:
        FileNotFoundError: no transformer in the directory. ValueError: two experts and no boundary_ratio, or a
            boundary_ratio for a directory with one expert.
    """
    from diffusers import WanTransformer3DModel

    path = Path(path)
    first = load_pretrained_transformer(WanTransformer3DModel, path, dtype=dtype, device=device)
    ratio = boundary_ratio if boundary_ratio is not None else _read_boundary_ratio(path)
    if not (path / "transformer_2").is_dir():
        if boundary_ratio is not None:
            raise ValueError(
                f"boundary_ratio {boundary_ratio} was given but {path} holds one transformer (no transformer_2/): "
                f"unset boundary_ratio, or point at a Wan 2.2 A14B directory."
            )
        return first
    if ratio is None:
        raise ValueError(
            f"{path} holds two experts (transformer/, transformer_2/) but no boundary_ratio (model_index.json has "
            f"none): set boundary_ratio (Wan2.2-T2V-A14B uses 0.875)."
        )
    second = load_pretrained_transformer(WanTransformer3DModel, path / "transformer_2", dtype=dtype, device=device)
    return WanExperts(first, second, ratio).eval()


def _load_prompt_encoder(path, device, settings: PipelineSettings) -> PromptEncoder:
    """The checkpoint's own UMT5 encoder through diffusers' `WanPipeline` (transformers and VAE not loaded)."""
    from diffusers import WanPipeline

    pipeline = WanPipeline.from_pretrained(path, transformer=None, transformer_2=None, vae=None).to(device)

    def encode_one(texts: list[str]) -> dict[str, torch.Tensor]:
        embeds, _ = pipeline.encode_prompt(
            texts, do_classifier_free_guidance=False, max_sequence_length=settings.max_sequence_length, device=device
        )
        return {TEXT_KEYS[0]: embeds.float().cpu()}

    return functools.partial(encode_prompt_pairs, encode_one)


FAMILY = register_family(
    ModelFamily(
        name="wan",
        velocity=velocity,
        latent_shape=_latent_shape,
        initial_latents=_initial_latents,
        scheduler_setup=_scheduler_setup,
        check_conditioning=_check_conditioning,
        collate_conditioning=collate_conditioning,
        scheduler_config=WAN_SCHEDULER_CONFIG,
        options=_pipeline_options,
        guidance=_guidance_scale,
        cfg_scale=_guidance_scale,
        negative_prompt="",
        load_transformer=load_transformer,
        load_prompt_encoder=_load_prompt_encoder,
        # Batch-first inputs, and the per-row expert names (a list) of a two-expert model.
        row_inputs=frozenset({"hidden_states", "timestep", "encoder_hidden_states", "experts"}),
        experts=_experts,
        model_kwargs=_model_kwargs,
        default_options=_DEFAULT_OPTIONS,
    )
)


# The family's public entry points (their keywords: the module docstring; one implementation for all families).
rollout, recompute_log_probs = entry_points(FAMILY, __name__)
