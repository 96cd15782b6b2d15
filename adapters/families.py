# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Model families: one frozen [`ModelFamily`] per family, and the registry that finds it by name.

A model family (Qwen-Image, SD3, FLUX, Wan, or yours) is a frozen bundle of plain functions, chiefly its
*velocity function*

    velocity(transformer, latents, timesteps, conditioning, guidance_scale, *, options)
        latents    (B, *latent_shape) float32
        timesteps  (B,) float32, exact schedule values (per sample: a batch may mix steps)
        returns    (B, *latent_shape) float32

which casts the latents to the transformer's dtype only for the forward, casts the prediction back to
float32, and applies classifier-free guidance in float32. The rollout (`rollout_consistency.adapters.rollout`),
the trainer (`rollout_consistency.adapters.trainer`), the step-wise engine and the checker use only the
fields of a `ModelFamily`, never a family's name.

Adding a family is one module that builds a `ModelFamily` and calls [`register_family`] (see
docs/design.md). The built-in families (`rollout_consistency.base.builtin_families`: one record each, naming its
module) are imported on first use by name, so `import rollout_consistency.adapters` stays light and a family
with a missing optional dependency does not break the others.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES
from rollout_consistency.schedulers import SchedulerSetup

from .settings import PipelineSettings

__all__ = [
    "ModelFamily",
    "PromptEncoder",
    "VelocityFn",
    "check_float32_inputs",
    "check_pooled_text",
    "common_conditioning_keys",
    "concat_fixed_width_conditioning",
    "encode_prompt_pairs",
    "family_names",
    "get_family",
    "load_pretrained_transformer",
    "load_scheduler_config",
    "merged_options",
    "model_device",
    "model_dtype",
    "register_family",
]

ModelT = TypeVar("ModelT", bound=nn.Module)


class VelocityFn(Protocol):
    def __call__(
        self,
        transformer: nn.Module,
        latents: torch.Tensor,
        timesteps: torch.Tensor,
        conditioning: Mapping[str, torch.Tensor],
        guidance_scale: float,
        *,
        options: Mapping[str, Any],
    ) -> torch.Tensor: ...


class PromptEncoder(Protocol):
    """Prompt texts to a family's batch-first conditioning (float32 embeddings, int64 masks)."""

    def __call__(self, prompts: Sequence[str], negative_prompts: Sequence[str] | None) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class ModelFamily:
    """The per-family functions the shared loops and the checker need. All are plain functions of their arguments.

    Used by the rollout, the trainer and the step-wise engine:
        name: the family id stored in trajectories (`"qwen-image"`, `"sd3"`, `"flux"`, `"wan"`).
        velocity: see [`VelocityFn`] and the module docstring.
        latent_shape: `(transformer, options) -> tuple` — per-sample latent shape the velocity takes.
        initial_latents: `(transformer, generators, options) -> Tensor (B, *latent_shape) float32` — draws
            each sample's initial noise from its own CPU generator (one generator per sample, in order).
        scheduler_setup: `(scheduler_config, num_inference_steps, transformer, options) -> SchedulerSetup` —
            the schedule the family's diffusers pipeline would use.
        check_conditioning: `(transformer, conditioning, batch_size, guidance_scale, options) -> None` —
            raises ValueError/TypeError naming the fix for missing or malformed conditioning (mask/embedding
            length mismatch, CFG without a negative prompt, wrong embedding width, ...).
        collate_conditioning: `(list of per-request conditionings, width or None) -> conditioning` — batches
            per-request conditionings (each batch-first) for one forward, padding text to `width` (or to
            the widest when `None`). Used by the step-wise path and `stack_trajectories`.
        row_inputs: the transformer's keyword inputs that are batch-first tensors or per-sample lists, which
            batch-invariant mode splits by row (`rollout_consistency.adapters.batch_invariance`).
        default_options: the family options besides `height` and `width` (which every family needs) with
            their defaults, e.g. `{"vae_scale_factor": 8}`: [`merged_options`] fills them in and refuses
            other names (a family's pipeline-style `rollout` stores them all).

    Used by the checker to build a run from [`PipelineSettings`] (a family without them can still roll out
    and recompute; the checker then says which field is missing):
        scheduler_config: the released scheduler config (the default when no model directory is given).
        options: `(PipelineSettings) -> dict` — the family options (stored as `Trajectory.family_options`).
        guidance: `(PipelineSettings) -> float` — the `guidance_scale` the velocity function takes.
        cfg_scale: `(PipelineSettings) -> float` — the classifier-free guidance scale; > 1 means two forwards
            per step and a negative prompt.
        negative_prompt: the negative prompt text the pipeline uses by default under CFG.
        load_transformer: `(path, *, dtype, device) -> nn.Module` — a real checkpoint's transformer in eval mode.
        load_prompt_encoder: `(path, device, PipelineSettings) -> PromptEncoder` — a real checkpoint's text
            encoders (through its diffusers pipeline).
        model_kwargs: `(PipelineSettings) -> dict` — extra keyword arguments for `load_transformer` and the tiny
            model's loader (Wan: `boundary_ratio`, which makes the model two experts); `None`: none.

    Families whose model is a mixture of experts by timestep (Wan 2.2) also set:
        experts: `(transformer, timesteps (B,) float32, options) -> tuple[str, ...] | None` — the expert that
            takes each row's step on this model (`None` for a single-expert model). The rollout records it per
            window step (`Trajectory.experts`), the trainer reports its own, and the checker compares them.
    """

    name: str
    velocity: VelocityFn
    latent_shape: Callable[[nn.Module, Mapping[str, Any]], tuple[int, ...]]
    initial_latents: Callable[[nn.Module, Sequence[torch.Generator], Mapping[str, Any]], torch.Tensor]
    scheduler_setup: Callable[[Mapping[str, Any], int, nn.Module, Mapping[str, Any]], SchedulerSetup]
    check_conditioning: Callable[[nn.Module, Mapping[str, torch.Tensor], int, float, Mapping[str, Any]], None]
    collate_conditioning: Callable[[Sequence[Mapping[str, torch.Tensor]], int | None], dict[str, torch.Tensor]]
    row_inputs: frozenset[str] = frozenset()
    default_options: Mapping[str, Any] = field(default_factory=dict)
    scheduler_config: Mapping[str, Any] | None = None
    options: Callable[[PipelineSettings], dict[str, Any]] | None = None
    guidance: Callable[[PipelineSettings], float] | None = None
    cfg_scale: Callable[[PipelineSettings], float] | None = None
    negative_prompt: str = ""
    load_transformer: Callable[..., nn.Module] | None = None
    load_prompt_encoder: Callable[[str | os.PathLike, Any, PipelineSettings], PromptEncoder] | None = None
    model_kwargs: Callable[[PipelineSettings], dict[str, Any]] | None = None
    experts: Callable[[nn.Module, torch.Tensor, Mapping[str, Any]], tuple[str, ...] | None] | None = None


# name -> family: the process's registry (built-ins on first use, user families when they register).
_REGISTRY: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Make `family` known by `family.name` to `get_family` (trajectories, the step-wise engine, the checker).

    Registering the same object again is a no-op; another family under a taken name is a ValueError unless
    `replace=True`. Returns `family`, so a module can write `FAMILY = register_family(ModelFamily(...))`.
    """
    if not isinstance(family, ModelFamily):
        raise TypeError(f"register_family takes a ModelFamily, got {type(family).__name__}.")
    known = _REGISTRY.get(family.name)
    if known is not None and known is not family and not replace:
        raise ValueError(
            f"A model family named {family.name!r} is already registered; pick another name, or pass replace=True."
        )
    _REGISTRY[family.name] = family
    return family


def get_family(name: str) -> ModelFamily:
    """The registered [`ModelFamily`] called `name` (a trajectory's `model_family`); ValueError naming the known ones."""
    if name not in _REGISTRY and name in BUILTIN_FAMILIES:
        importlib.import_module(BUILTIN_FAMILIES[name].module)  # registers its FAMILY (the built-in table's module)
    if name not in _REGISTRY:
        raise ValueError(
            f"Unknown model family {name!r}; known: {', '.join(family_names())} (a new family registers itself "
            f"with rollout_consistency.adapters.register_family)."
        )
    return _REGISTRY[name]


def family_names() -> tuple[str, ...]:
    """Names of the built-in and registered families, sorted."""
    return tuple(sorted(set(BUILTIN_FAMILIES) | set(_REGISTRY)))


def merged_options(family: ModelFamily, options: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """`options` over the family's `default_options`, `height` and `width` first (ValueError if either is missing).

    With `strict`, every value is cast to its default's type (`int`, `bool`, `float`) and a name the family
    does not know is a ValueError naming the known ones (a caller's keywords); otherwise other names pass
    through (a stored trajectory's options are read as they are).
    """
    for key in ("height", "width"):
        if key not in options:
            raise ValueError(f"{family.name} options need {key!r} (image size in pixels).")
    defaults = dict(family.default_options)
    if not strict:
        return {**defaults, **dict(options)}
    unknown = sorted(set(options) - {"height", "width", *defaults})
    if unknown:
        raise ValueError(
            f"{family.name} has no option {', '.join(map(repr, unknown))}; its options are height, width"
            f"{''.join(f', {name}' for name in defaults)}."
        )
    merged = {"height": int(options["height"]), "width": int(options["width"])}
    for name, value in defaults.items():  # a None default (an optional setting) keeps what was given
        given = options.get(name, value)
        merged[name] = given if value is None or given is None else type(value)(given)
    return merged


def load_pretrained_transformer(
    model_class: type[ModelT], path: str | os.PathLike, *, dtype: torch.dtype, device: torch.device | str
) -> ModelT:
    """A diffusers transformer from a local model directory (its `transformer/` subfolder, or the folder
    itself), on `device`, in `dtype`, in eval mode. FileNotFoundError when the directory is missing or holds
    no transformer config."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"No model directory at {path}.")
    subfolder = "transformer" if (path / "transformer").is_dir() else None
    if not (path / (subfolder or "") / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a diffusers model directory (no transformer/config.json or config.json); pass the "
            f"folder a pipeline's save_pretrained wrote"
        )
    # from_pretrained casts to `dtype` but keeps the class's `_keep_in_fp32_modules` (Wan: its norms, time
    # embedder, RoPE) in float32, as a user's own `Pipeline.from_pretrained(torch_dtype=...)` does; a dtype cast
    # here would round them, and the two sides would not be the same model. Only the device moves.
    model = model_class.from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
    return nn.Module.to(model, device=device).eval()


def load_scheduler_config(path: str | os.PathLike) -> dict[str, Any]:
    """The scheduler config of a local model directory (`scheduler/scheduler_config.json`, or the file in it)."""
    path = Path(path)
    candidates = [path / "scheduler" / "scheduler_config.json", path / "scheduler_config.json"]
    for candidate in candidates:
        if candidate.is_file():
            return {k: v for k, v in json.loads(candidate.read_text()).items() if not k.startswith("_")}
    raise FileNotFoundError(f"No scheduler config under {path} (looked for {', '.join(map(str, candidates))}).")


def encode_prompt_pairs(
    encode: Callable[[list[str]], Mapping[str, torch.Tensor]],
    prompts: Sequence[str],
    negative_prompts: Sequence[str] | None,
) -> dict[str, torch.Tensor]:
    """A [`PromptEncoder`]'s loop: `encode(texts)` without grad on the prompts, then on the negative prompts when
    given, whose keys take the prefix `negative_` (`prompt_embeds` → `negative_prompt_embeds`, as diffusers'
    pipelines name them). `encode` returns one text's batch-first float32 embeddings (int64 masks) on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for prefix, texts in (("", prompts), ("negative_", negative_prompts)):
        if texts is None:
            continue
        with torch.no_grad():
            encoded = encode(list(texts))
        out.update({f"{prefix}{key}": value for key, value in encoded.items()})
    return out


def model_dtype(transformer: nn.Module) -> torch.dtype:
    """Dtype of the transformer's floating parameters (what its forward computes in)."""
    for parameter in transformer.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def model_device(transformer: nn.Module) -> torch.device:
    """Device of the transformer's first parameter (where its inputs must live); CPU for a parameterless one."""
    for parameter in transformer.parameters():
        return parameter.device
    return torch.device("cpu")


def check_float32_inputs(latents: torch.Tensor, timesteps: torch.Tensor) -> None:
    """TypeError unless a velocity function's `latents` and `timesteps` are float32 (see the module docstring)."""
    if latents.dtype != torch.float32 or timesteps.dtype != torch.float32:
        raise TypeError(
            f"velocity() takes float32 latents and timesteps (got {latents.dtype}, {timesteps.dtype}); the adapters "
            f"keep them float32 and cast to the transformer's dtype only here, for the forward."
        )


def common_conditioning_keys(conditionings: Sequence[Mapping[str, torch.Tensor]]) -> set[str]:
    """The conditioning keys every request shares; ValueError for no requests or requests with different keys
    (they cannot share a forward)."""
    if not conditionings:
        raise ValueError("collate_conditioning needs at least one request.")
    keys = set(conditionings[0])
    for cond in conditionings[1:]:
        if set(cond) != keys:
            raise ValueError(
                f"Requests with different conditioning keys cannot share a forward: {sorted(keys)} vs {sorted(cond)}."
            )
    return keys


def check_pooled_text(
    transformer: nn.Module,
    conditioning: Mapping[str, torch.Tensor],
    embeds_key: str,
    pooled_key: str,
    batch: int,
    *,
    family_label: str,
) -> None:
    """Check one text of a CLIP + T5 family (SD3, FLUX): `embeds_key` `(B, L, joint_attention_dim)` and
    `pooled_key` `(B, pooled_projection_dim)`, both float32 with `batch` rows.

    Raises:
        ValueError: a missing tensor, or a wrong rank, row count or width. TypeError: not float32.
    """
    config = transformer.config
    for key, expected, layout in (
        (embeds_key, int(config.joint_attention_dim), "(B, L, joint_attention_dim)"),
        (pooled_key, int(config.pooled_projection_dim), "(B, pooled_projection_dim)"),
    ):
        tensor = conditioning.get(key)
        if tensor is None:
            raise ValueError(
                f"{family_label} conditioning has no {key!r} {layout}; pass both outputs of encode_prompt for this "
                f"text ({embeds_key!r} and {pooled_key!r})."
            )
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != layout.count(",") + 1:
            raise ValueError(
                f"{family_label} {key} must be a {layout} tensor, got {getattr(tensor, 'shape', tensor)!r}."
            )
        if tensor.dtype != torch.float32:
            raise TypeError(
                f"{family_label} {key} is {tensor.dtype}; pass float32 embeddings (they are stored as given)."
            )
        if tensor.shape[0] != batch:
            raise ValueError(
                f"{family_label} {key} has {tensor.shape[0]} rows for {batch} samples (seeds); pass one row per sample."
            )
        if tensor.shape[-1] != expected:
            raise ValueError(
                f"{family_label} {key} has width {tensor.shape[-1]} but this transformer takes {expected} {layout}."
            )


def concat_fixed_width_conditioning(
    conditionings: Sequence[Mapping[str, torch.Tensor]],
    width: int | None,
    *,
    text_keys: Sequence[str],
    pipeline: str,
) -> dict[str, torch.Tensor]:
    """Batch per-request conditionings of a family whose transformer attends to text padding (SD3, FLUX).

    No key-padding mask means zero-padding an embedding to a wider shared width would change the
    prediction, so requests must share one text width (the encoder's fixed `max_sequence_length`) and are
    concatenated as they are; a `width` other than theirs is refused.

    Raises:
        ValueError: no requests, different keys, different text widths, or a `width` that needs padding.
    """
    keys = common_conditioning_keys(conditionings)
    for embeds_key in text_keys:
        if embeds_key not in keys:
            continue
        widths = {int(c[embeds_key].shape[1]) for c in conditionings}
        if len(widths) > 1 or (width is not None and widths != {width}):
            raise ValueError(
                f"{pipeline} requests with {embeds_key} widths {sorted(widths)} cannot share a forward"
                f"{'' if width is None else f' at width {width}'}: the transformer attends to padding tokens (no "
                f"text mask), so re-padding changes the prediction. Encode every prompt to the same fixed length, "
                f"as {pipeline} does (max_sequence_length)."
            )
    return {key: torch.cat([c[key] for c in conditionings]) for key in sorted(keys)}
