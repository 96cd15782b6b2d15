"""The SD3 and FLUX families as the adapter tests drive them: a table of per-family settings and the
standard rollout / recompute of these tests (shared by test_sd3_flux_adapters.py and the per-family files)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, StableDiffusion3Pipeline
from rollout_args import rollout_args

from rollout_consistency.adapters import Trajectory, flux, sd3
from rollout_consistency.adapters.tiny.sd3_flux import (
    TINY_FLUX_CONFIG,
    TINY_SD3_CONFIG,
    load_flux,
    load_sd3,
    tiny_flux_prompt_encoder,
    tiny_sd3_prompt_encoder,
)
from rollout_consistency.schedulers import SDEWindow

PROMPTS = ["a red cat", "a dog in the garden at night", "sky", "photo of a small blue house near the river"]
SEEDS = [1, 2, 3, 4]
SIZE = {"height": 64, "width": 64}


@dataclass(frozen=True)
class Family:
    """One model family as these tests drive it."""

    name: str
    adapter: ModuleType  # rollout_consistency.adapters.sd3 or rollout_consistency.adapters.flux
    load: Callable[..., torch.nn.Module]
    prompt_encoder: Callable[[], Any]
    config: Mapping[str, Any]  # the tiny transformer's config
    pipeline: Callable[[torch.nn.Module], Any]  # the diffusers pipeline around a transformer, latents only
    guidance_scale: float  # the rollouts' guidance_scale
    cfg_options: Mapping[str, float]  # further CFG settings the rollouts pass (stored in family_options)
    cfg_key: str  # the setting that turns CFG (a second forward on the negative prompt) on above 1
    gradient_step: int  # the step whose log-prob is backpropagated
    trained_weight: Callable[[torch.nn.Module], torch.Tensor]  # a weight that step's gradient must reach
    last_step_clips_every_sample: bool  # the bf16 pitfall shows in every sample at the last step

    @property
    def cfg(self) -> dict[str, float]:
        """The CFG settings of the standard rollout."""
        return {"guidance_scale": self.guidance_scale, **self.cfg_options}

    def conditioning(
        self, prompts: Sequence[str], negative_prompts: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        return self.prompt_encoder().conditioning(prompts, negative_prompts)


def _sd3_pipeline(transformer):
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**sd3.SD3_SCHEDULER_CONFIG),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )


def _flux_pipeline(transformer):
    return FluxPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**flux.FLUX_SCHEDULER_CONFIG),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
    )


SD3 = Family(
    name="sd3",
    adapter=sd3,
    load=load_sd3,
    prompt_encoder=tiny_sd3_prompt_encoder,
    config=TINY_SD3_CONFIG,
    pipeline=_sd3_pipeline,
    guidance_scale=4.5,
    cfg_options={},
    cfg_key="guidance_scale",
    gradient_step=1,
    trained_weight=lambda model: model.proj_out.weight,
    # SD3's own schedule ends at a tiny σ (0.009 here), where the step's std nears bf16 resolution.
    last_step_clips_every_sample=True,
)
FLUX = Family(
    name="flux",
    adapter=flux,
    load=load_flux,
    prompt_encoder=tiny_flux_prompt_encoder,
    config=TINY_FLUX_CONFIG,
    pipeline=_flux_pipeline,
    guidance_scale=3.5,
    cfg_options={"true_cfg_scale": 2.0},
    cfg_key="true_cfg_scale",
    gradient_step=2,
    trained_weight=lambda model: model.time_text_embed.guidance_embedder.linear_1.weight,
    last_step_clips_every_sample=False,
)
FAMILIES = {family.name: family for family in (SD3, FLUX)}


def rollout(family: Family, model, cond, **kwargs) -> Trajectory:
    """The standard rollout of these tests (6 steps, SDE window 1..3, the family's CFG), `kwargs` overriding."""
    args = dict(
        num_inference_steps=6,
        seeds=SEEDS,
        window=SDEWindow(start=1, size=3, num_steps=6),
        noise_level=0.7,
        **family.cfg,
        **SIZE,
    )
    args.update(kwargs)
    return family.adapter.rollout(model, cond, **rollout_args(args))


def recompute(family: Family, model, trajectory, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return family.adapter.recompute_log_probs(model, trajectory, **kwargs)
