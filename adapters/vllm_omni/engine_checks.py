# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Engine-side checks: the engine configurations and sampling params the rollout pipeline refuses.

Both raise ValueError naming the fix and override nothing: the pipeline class in vLLM-omni's worker calls
[`check_engine_settings`] when the engine loads it and [`check_sampling_params`] for every decoded request.
"""

from __future__ import annotations

from typing import Any

from .protocol import RolloutRequest

__all__ = ["check_engine_config", "check_engine_settings", "check_sampling_params"]


def check_engine_config(od_config: Any, **model: bool) -> None:
    """[`check_engine_settings`] of a vLLM-omni `OmniDiffusionConfig` (read by attribute: no vLLM import here);
    `model`: the transformer's own flags (`guidance_embeds`, `zero_cond_t`)."""
    parallel = od_config.parallel_config
    check_engine_settings(
        cfg_parallel_size=parallel.cfg_parallel_size,
        sequence_parallel_size=parallel.sequence_parallel_size,
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        cache_backend=od_config.cache_backend,
        quantized=od_config.quantization_config is not None,
        **model,
    )


def check_engine_settings(
    *,
    cfg_parallel_size: int = 1,
    sequence_parallel_size: int | None = 1,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    cache_backend: str | None = None,
    guidance_embeds: bool = False,
    zero_cond_t: bool = False,
    quantized: bool = False,
) -> None:
    """ValueError for engine settings the rollout pipeline does not support (checked when the engine loads it).

    Parallel sizes must be 1 (one GPU per engine; CFG runs its two passes sequentially), no step cache
    (TeaCache & co. skip forwards, so the trainer would score other computations), unquantized weights (the
    trainer's), and the plain Qwen-Image transformer (no guidance-distilled or editing variant).
    """
    sizes = {
        "cfg_parallel_size": cfg_parallel_size,
        "sequence_parallel_size": sequence_parallel_size or 1,
        "tensor_parallel_size": tensor_parallel_size,
        "pipeline_parallel_size": pipeline_parallel_size,
    }
    wrong = {name: size for name, size in sizes.items() if size != 1}
    if wrong:
        raise ValueError(
            f"The rollout-consistency pipeline runs on one GPU per engine; got {wrong}. Start one engine per GPU "
            f"(data parallel) instead."
        )
    if cache_backend not in (None, "none"):
        raise ValueError(
            f"cache_backend={cache_backend!r} reuses transformer outputs across steps, so the trainer would score a "
            f"different computation; start the engine with cache_backend='none'."
        )
    if quantized:
        raise ValueError(
            "The engine quantizes the transformer, so the rollout scores other weights than the trainer; start it "
            "without quantization for the consistency check."
        )
    if guidance_embeds or zero_cond_t:
        raise ValueError(
            "This Qwen-Image transformer is a guidance-distilled or editing variant (guidance_embeds / zero_cond_t); "
            "the rollout pipeline supports the text-to-image model only."
        )


def check_sampling_params(
    request: RolloutRequest,
    *,
    num_inference_steps: int | None,
    height: int | None,
    width: int | None,
    num_outputs_per_prompt: int,
    has_latents: bool,
    has_custom_schedule: bool,
    vae_scale_factor: int,
) -> None:
    """ValueError when vLLM-omni's sampling params contradict the request's settings (nothing is overridden)."""
    batch = request.batch
    steps = batch.scheduler.num_inference_steps
    if num_inference_steps is not None and num_inference_steps != steps:
        raise ValueError(
            f"sampling_params.num_inference_steps={num_inference_steps} but the request's schedule has {steps}."
        )
    for name, value in (("height", height), ("width", width)):
        if value is not None and value != batch.options[name]:
            raise ValueError(f"sampling_params.{name}={value} but the request's settings say {batch.options[name]}.")
    if num_outputs_per_prompt not in (0, 1):
        raise ValueError(
            f"num_outputs_per_prompt={num_outputs_per_prompt}: send one request per rollout (each with its own seed), "
            f"not several outputs per prompt."
        )
    if has_latents:
        raise ValueError(
            "sampling_params.latents is set: the pipeline draws the initial noise from the request's seed."
        )
    if has_custom_schedule:
        raise ValueError("sampling_params.sigmas/timesteps are set: the schedule comes from the request's settings.")
    if int(batch.options.get("vae_scale_factor", 8)) != int(vae_scale_factor):
        raise ValueError(
            f"The request's vae_scale_factor {batch.options.get('vae_scale_factor', 8)} differs from the model's "
            f"{vae_scale_factor}."
        )
