# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Rollout and training adapters on diffusers, with float32 trajectories.

Public API (stable; see docs/adapters.md):

Trajectory format (`rollout_consistency.adapters.trajectory`)
    Trajectory                frozen dataclass: latents (B, W+1, *latent) f32, log_probs (B, W) f32,
                              timesteps (B, W) f32, windows (one SDEWindow per sample), noise_level, sde_type,
                              guidance_scale, seeds, prompt_groups, global_step, conditioning, model_family,
                              scheduler (SchedulerSetup), family_options, include_normalizer, final_latents,
                              provenance; .validate(), .save(path), Trajectory.load(path), .select(idx), .window
    TrajectoryFormatError     bad / truncated / corrupted / non-fp32 file
    stack_trajectories        concatenate trajectories (pads text conditioning)
    SchedulerSetup            scheduler config + set_timesteps args; .build() -> FlowMatchSDEDiscreteScheduler

Family-agnostic core (`rollout_consistency.adapters.denoise`)
    ModelFamily               per-family functions (velocity, latent_shape, initial_latents, scheduler_setup,
                              check_conditioning, collate_conditioning)
    rollout(family, transformer, conditioning, *, scheduler_setup, seeds, window, noise_level, ...) -> Trajectory
    recompute_log_probs(transformer, trajectory, *, family=None, steps=None, autocast_dtype=None) -> (B, W) f32
    recompute_step_log_prob(transformer, trajectory, k, ...) -> (B,) f32 (differentiable)
    get_family(name), make_generators(seeds)

Qwen-Image (`rollout_consistency.adapters.qwen_image`, `rollout_consistency.adapters.tiny_qwen_image`, `rollout_consistency.adapters.rope`)
    qwen_image.rollout(transformer, conditioning, *, height, width, num_inference_steps, seeds, window,
                       noise_level, sde_type="sde", guidance_scale=1.0, ...) -> Trajectory
    qwen_image.recompute_log_probs(transformer, trajectory, *, steps=None, autocast_dtype=None)
    qwen_image.velocity, qwen_image.FAMILY, qwen_image.pad_text_conditioning
    load_qwen_image(path=None, *, dtype, device, seed), load_qwen_image_scheduler_config(path=None),
    TinyPromptEncoder (.encode, .conditioning)
    padded_txt_seq_lens(prompt_embeds), QwenImageTransformerTxtSeqLens

Step-wise continuous batching (`rollout_consistency.adapters.stepwise`, imported on first use)
    stepwise.run_stepwise(family, transformer, requests, *, scheduler_setup, noise_level, max_num_seqs,
                          text_width=None, ...) -> Trajectory (rows in request order)
    stepwise.StepwiseRequest(request_id, seed, conditioning, window, prompt_group=0, arrival=0)
    plain functions for other engines (vLLM-omni): init_request, gather_latents, shared_text_width,
    scheduler_step, init_window_record, record_window_step, window_trajectory, denoise_step

Stock-behaviour reproductions (`rollout_consistency.adapters.pitfalls`; tests and `--inject` only)
    Injection(bf16_latents, stepwise_bf16, mask_sum_rope, per_request_window), Injection.from_names(names),
    INJECTION_NAMES, MixedDtypeBatchError; pass `injection=` to a rollout

SD3 and FLUX (`rollout_consistency.adapters.sd3`, `rollout_consistency.adapters.flux`, imported on first use; tiny models in `rollout_consistency.adapters.tiny_sd3_flux`)
    sd3.rollout / flux.rollout (same shape as qwen_image.rollout; FLUX adds true_cfg_scale),
    sd3.recompute_log_probs / flux.recompute_log_probs, sd3.FAMILY / flux.FAMILY,
    load_sd3(path=None, *, dtype, device, seed), load_flux(...), TinyClipT5Encoder,
    tiny_sd3_prompt_encoder(), tiny_flux_prompt_encoder()

vLLM-omni backend (`rollout_consistency.adapters.vllm_omni`, imported on first use; vLLM is imported only when an engine starts)
    VllmOmniRollout(model_path, *, dtype, step_execution, max_num_seqs, launcher_seed, window_schedule, ...)
        .from_check_config(config), .rollout(family, transformer, conditioning, **rollout args) -> Trajectory, .close()
    build_requests / decode_request   settings carried in the prompt and sampling_params.extra_args
    start_request / batch_noise_pred / advance_request / finish_request   the engine's per-request steps
    trajectory_to_payload / trajectory_from_payload / order_by_sample_index / collect_trajectories
    rollout_consistency.adapters.vllm_omni_pipeline.RolloutQwenImagePipeline: the class vLLM-omni's worker loads (PIPELINE_CLASS)

Importing `adapters` never imports vllm.
"""

from __future__ import annotations

import importlib

from . import qwen_image
from .denoise import (
    ModelFamily,
    get_family,
    make_generators,
    recompute_log_probs,
    recompute_step_log_prob,
    rollout,
)
from .pitfalls import INJECTION_NAMES, Injection, MixedDtypeBatchError
from .rope import QwenImageTransformerTxtSeqLens, padded_txt_seq_lens
from .schedule import SchedulerSetup
from .tiny_qwen_image import TinyPromptEncoder, load_qwen_image, load_qwen_image_scheduler_config
from .trajectory import Trajectory, TrajectoryFormatError, stack_trajectories

__all__ = [
    "INJECTION_NAMES",
    "Injection",
    "MixedDtypeBatchError",
    "ModelFamily",
    "QwenImageTransformerTxtSeqLens",
    "SchedulerSetup",
    "TinyPromptEncoder",
    "Trajectory",
    "TrajectoryFormatError",
    "get_family",
    "load_qwen_image",
    "load_qwen_image_scheduler_config",
    "make_generators",
    "padded_txt_seq_lens",
    "qwen_image",
    "recompute_log_probs",
    "recompute_step_log_prob",
    "rollout",
    "stack_trajectories",
]

_LAZY_SUBMODULES = ("sd3", "flux", "stepwise", "vllm_omni")


def __getattr__(name: str):
    # Submodules written by other engineers, or with heavy optional imports, load on first access.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
