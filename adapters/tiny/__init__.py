# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Tiny offline models: seeded diffusers transformers from fixed configs and stand-in prompt encoders.

Everything runs on a CPU with no model hub. The checker uses [`get_tiny`] when no `model_path` is given;
tests and docs build the models directly:

    Qwen-Image   load_qwen_image(path=None, *, dtype, device, seed, config), TinyPromptEncoder,
                 save_tiny_qwen_image_directory(path, *, dtype) (a whole diffusers directory),
                 load_qwen_image_scheduler_config(path=None)          (`rollout_consistency.adapters.tiny.qwen_image`)
    SD3, FLUX    load_sd3(...), load_flux(...), TinyClipT5Encoder,
                 tiny_sd3_prompt_encoder(), tiny_flux_prompt_encoder(),
                 load_sd3_scheduler_config(path=None), load_flux_scheduler_config(path=None)
                                                                      (`rollout_consistency.adapters.tiny.sd3_flux`)
    Wan          load_wan(..., boundary_ratio=None), TinyUMT5Encoder,
                 tiny_wan_prompt_encoder(), load_wan_scheduler_config(path=None)
                                                                      (`rollout_consistency.adapters.tiny.wan`)

`load_qwen_image`, `load_sd3` and `load_flux` are [`TinyTransformer`]s (a model class and its tiny config, called
as a function); `load_wan` adds Wan 2.2's two experts. Each `load_*_scheduler_config(path=None)` gives the scheduler
config the tiny model runs with (the family's released one, `ModelFamily.scheduler_config`), as
`from_pretrained(path, subfolder="scheduler")` would read it from a model directory; with `path`, that directory's own.

A family of your own registers its tiny model with [`register_tiny`] next to
`rollout_consistency.adapters.register_family`. No production module imports this package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from torch import nn

from rollout_consistency.adapters.families import PromptEncoder
from rollout_consistency.adapters.settings import PipelineSettings
from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES

from .qwen_image import (
    TinyPromptEncoder,
    TinyTransformer,
    load_qwen_image,
    load_qwen_image_scheduler_config,
    save_tiny_qwen_image_directory,
)
from .sd3_flux import (
    TinyClipT5Encoder,
    load_flux,
    load_flux_scheduler_config,
    load_sd3,
    load_sd3_scheduler_config,
    tiny_flux_prompt_encoder,
    tiny_sd3_prompt_encoder,
)
from .wan import TinyUMT5Encoder, load_wan, load_wan_scheduler_config, tiny_wan_prompt_encoder

__all__ = [
    "TINY_FLUX",
    "TINY_QWEN_IMAGE",
    "TINY_SD3",
    "TINY_WAN",
    "TinyClipT5Encoder",
    "TinyModel",
    "TinyPromptEncoder",
    "TinyTransformer",
    "TinyUMT5Encoder",
    "get_tiny",
    "load_flux",
    "load_flux_scheduler_config",
    "load_qwen_image",
    "load_qwen_image_scheduler_config",
    "load_sd3",
    "load_sd3_scheduler_config",
    "load_wan",
    "load_wan_scheduler_config",
    "register_tiny",
    "save_tiny_qwen_image_directory",
    "tiny_flux_prompt_encoder",
    "tiny_names",
    "tiny_sd3_prompt_encoder",
    "tiny_wan_prompt_encoder",
]


@dataclass(frozen=True)
class TinyModel:
    """A family's tiny offline model, as the checker builds it when no model directory is given.

    Attributes:
        load_transformer: `(*, dtype, device, seed, **model_kwargs) -> nn.Module` — the seeded tiny transformer in
            eval mode (`model_kwargs`: what the family's `ModelFamily.model_kwargs` gives, e.g. Wan's
            `boundary_ratio`).
        prompt_encoder: `(transformer, PipelineSettings) -> PromptEncoder` — a stand-in text encoder whose
            conditioning fits `transformer` (`(prompts, negative_prompts or None) -> conditioning`).

    The built-in ones pickle (their fields are module-level functions, `TinyTransformer`s and `functools.partial`s
    of them, no closures), so they can be sent to another process (multiprocessing, a spawned worker, Ray);
    give a model you register module-level functions too (`tests/test_tiny_models.py`).
    """

    load_transformer: Callable[..., nn.Module]
    prompt_encoder: Callable[[nn.Module, PipelineSettings], PromptEncoder]


def _qwen_image_encoder(transformer: nn.Module, settings: PipelineSettings) -> PromptEncoder:
    encoder = TinyPromptEncoder(int(transformer.config.joint_attention_dim), seed=0)
    pad_to = settings.max_sequence_length if settings.pad_prompts_to_max_length else None

    def encode(prompts, negative_prompts) -> dict[str, Any]:
        return encoder.conditioning(list(prompts), negative_prompts, pad_to=pad_to)

    return encode


def _clip_t5_encoder(
    make: Callable[..., TinyClipT5Encoder], transformer: nn.Module, settings: PipelineSettings
) -> PromptEncoder:
    # Seeded weights, the pipelines' fixed text length: built once per worker, not per batch.
    encoder = make(seed=0, max_length=settings.max_sequence_length)

    def encode(prompts, negative_prompts) -> dict[str, Any]:
        return encoder.conditioning(list(prompts), negative_prompts)

    return encode


def _wan_encoder(transformer: nn.Module, settings: PipelineSettings) -> PromptEncoder:
    # The tiny UMT5 stand-in at the pipeline's fixed text length: built once per worker, not per batch.
    encoder = TinyUMT5Encoder(int(transformer.config.text_dim), max_length=settings.max_sequence_length, seed=0)

    def encode(prompts, negative_prompts) -> dict[str, Any]:
        return encoder.conditioning(list(prompts), negative_prompts)

    return encode


# The built-in families' tiny models, each named by its family's record (`rollout_consistency.base.builtin_families`).
# Module-level functions and partials, no closures: each pickles (multiprocessing, a spawned process, Ray).
TINY_QWEN_IMAGE = TinyModel(load_transformer=load_qwen_image, prompt_encoder=_qwen_image_encoder)
TINY_SD3 = TinyModel(load_transformer=load_sd3, prompt_encoder=partial(_clip_t5_encoder, tiny_sd3_prompt_encoder))
TINY_FLUX = TinyModel(load_transformer=load_flux, prompt_encoder=partial(_clip_t5_encoder, tiny_flux_prompt_encoder))
TINY_WAN = TinyModel(load_transformer=load_wan, prompt_encoder=_wan_encoder)
# name -> tiny model: those a user family registers (a built-in one is found through its family's record).
_REGISTRY: dict[str, TinyModel] = {}


def register_tiny(name: str, tiny: TinyModel, *, replace: bool = False) -> TinyModel:
    """Make `tiny` the offline model of family `name` (used by the checker when `model_path` is None)."""
    if not isinstance(tiny, TinyModel):
        raise TypeError(f"register_tiny takes a TinyModel, got {type(tiny).__name__}.")
    known = _REGISTRY.get(name) or _builtin(name)
    if known is not None and known is not tiny and not replace:
        raise ValueError(f"A tiny model for family {name!r} is already registered; pass replace=True to replace it.")
    _REGISTRY[name] = tiny
    return tiny


def get_tiny(name: str) -> TinyModel:
    """The tiny model of family `name`; ValueError naming the families that have one."""
    found = _REGISTRY.get(name) or _builtin(name)
    if found is None:
        raise ValueError(
            f"No tiny offline model for family {name!r} (have: {', '.join(tiny_names())}): set model_path to a "
            f"model directory, or register one with rollout_consistency.adapters.tiny.register_tiny."
        )
    return found


def tiny_names() -> tuple[str, ...]:
    """Families with a tiny offline model, sorted."""
    return tuple(sorted(set(_REGISTRY) | {f.name for f in BUILTIN_FAMILIES.values() if f.tiny}))


def _builtin(name: str) -> TinyModel | None:
    """The tiny model a built-in family's record names (``"module:name"``), or None."""
    entry = BUILTIN_FAMILIES.get(name)
    if entry is None or entry.tiny is None:
        return None
    module, _, attribute = entry.tiny.partition(":")
    return getattr(importlib.import_module(module), attribute)
