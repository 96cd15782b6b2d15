# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The vLLM-omni rollout backend: request settings, per-request engine state, trajectory envelope, engine client.

Written against vLLM-omni 0.30.0 (`VLLM_OMNI_VERSION`). No module of this package imports vllm or vllm_omni at
import time; only [`VllmOmniRollout`] does, when it starts an engine, and without the package it raises
[`VllmOmniUnavailableError`] naming the extra to install. The pipeline class that vLLM-omni's worker loads lives
in `rollout_consistency.adapters.vllm_omni.pipeline` (for Wan: `wan_pipeline`; the only modules that import vLLM at
their top); each is a thin shell over the plain functions here, which are tested on the CPU with the diffusers
transformer. Every name below (but `pipeline`'s and `wan_pipeline`'s) is importable from this package; the modules:

    protocol       the wire protocol: BatchSettings, RequestSettings, RolloutRequest, build_requests,
                   decode_request, resolve_window, PAYLOAD_KEY, PAYLOAD_VERSION, PIPELINE_CLASS,
                   PIPELINE_CLASSES
    engine_checks  engine settings and sampling params the pipeline refuses: check_engine_config, check_engine_settings,
                   check_sampling_params
    worker         per-request engine state: TransformerView, RolloutState, start_request, batch_noise_pred,
                   batch_experts, advance_request, finish_request, and request mode's wave: decode_wave,
                   run_request_wave
    wan_pipeline   `RolloutWanPipeline`, vLLM-omni's Wan 2.2 pipeline class for Wan rollouts (imports vLLM; loaded
                   only by vLLM-omni's worker, through `PIPELINE_CLASSES["wan"]`)
    envelope       the trajectory's way back: trajectory_to_payload, output_envelope, order_by_sample_index,
                   trajectory_from_payload, ENVELOPE_FORMAT
    client         the engine client: VllmOmniRollout, engine_kwargs, sampling_params_kwargs,
                   collect_trajectories, rollout (the guard without an engine)
    errors         availability and errors: vllm_omni_available, require_vllm_omni, VllmOmni*Error,
                   INSTALL_HINT, VLLM_OMNI_VERSION

Data flow (docs/vllm-omni.md)::

    client (this process)                          vLLM-omni worker (rollout_consistency.adapters.vllm_omni.pipeline)
    build_requests(...)  ── prompt dicts ──────▶   decode_request(prompt, sampling.extra_args)
      per request: prompt["additional_information"]    start_request  (prepare_encode / forward)
        ["rollout_consistency"]["request"]             batch_noise_pred (denoise_step, one forward)
      batch-wide: sampling_params.extra_args           advance_request  (step_scheduler, per request)
        ["rollout_consistency"]["batch"]               finish_request + trajectory_to_payload (post_decode)
    order_by_sample_index + trajectory_from_payload ◀── OmniRequestOutput.multimodal_output["trajectory"]
    stack_trajectories → Trajectory (request order)

Guarantees (what the plain functions do; the vLLM shell only calls them):
    * Per-request latents are float32 from the initial draw to the stored trajectory; the transformer sees
      them cast to its dtype inside the forward only, and its output is cast to float32 before the strict
      scheduler entry point (`sample_previous_step`), which refuses anything else.
    * Noise follows `rollout_consistency.adapters.rollout`'s contract: one CPU generator per request seeded with its `seed`,
      initial noise first, then one draw per window step. A request's trajectory is therefore comparable
      draw for draw with the PyTorch rollout of the same seed, whatever its batch-mates.
    * The SDE window comes from the request's settings: explicit, and/or re-derived from (launcher seed,
      global step, prompt group) with the batch's `SDEWindowSchedule`; when both are sent they must agree.
    * Text is padded per forward to one shared width (`text_width`, or the widest running request) and
      the text RoPE length is that padded width (`rollout_consistency.adapters.rope.padded_txt_seq_lens`, applied by the
      family's velocity function). With a fixed `text_width` (the default when embeddings are sent) the
      stored conditioning has the width every forward used, so the trainer repeats the same computation.
    * Missing or malformed settings fail closed (ValueError naming the fix); only vLLM-omni's own warm-up
      request may run without them.
Not guaranteed:
    * Bit-equality with the PyTorch trainer: vLLM-omni's transformer has its own kernels (attention, bf16
      RoPE, fused QK-norm), so expect the `kernel` tolerance profile's floor, see docs/vllm-omni.md.
    * Bit-reproducibility across runs with `max_num_seqs > 1` in step mode: which requests share a forward
      depends on arrival timing in the engine.
"""

from __future__ import annotations

from .client import ENGINE_DTYPES as ENGINE_DTYPES  # served as before the split, not in __all__
from .client import (
    VllmOmniRollout,
    collect_trajectories,
    engine_kwargs,
    rollout,
    sampling_params_kwargs,
)
from .engine_checks import check_engine_config, check_engine_settings, check_sampling_params
from .envelope import (
    ENVELOPE_FORMAT,
    order_by_sample_index,
    output_envelope,
    trajectory_from_payload,
    trajectory_to_payload,
)
from .errors import (
    INSTALL_HINT,
    VLLM_OMNI_VERSION,
    VllmOmniEngineClosedError,
    VllmOmniEngineError,
    VllmOmniRequestError,
    VllmOmniUnavailableError,
    require_vllm_omni,
    vllm_omni_available,
)
from .protocol import (
    PAYLOAD_KEY,
    PAYLOAD_VERSION,
    PIPELINE_CLASS,
    PIPELINE_CLASSES,
    BatchSettings,
    PromptTexts,
    RequestSettings,
    RolloutRequest,
    build_requests,
    decode_request,
    resolve_window,
)
from .protocol import SUPPORTED_FAMILIES as SUPPORTED_FAMILIES  # served as before the split, not in __all__
from .worker import (
    RolloutState,
    TransformerView,
    advance_request,
    batch_experts,
    batch_noise_pred,
    decode_wave,
    finish_request,
    run_request_wave,
    start_request,
)

__all__ = [
    "ENVELOPE_FORMAT",
    "INSTALL_HINT",
    "PAYLOAD_KEY",
    "PAYLOAD_VERSION",
    "PIPELINE_CLASS",
    "PIPELINE_CLASSES",
    "VLLM_OMNI_VERSION",
    "BatchSettings",
    "PromptTexts",
    "RequestSettings",
    "RolloutRequest",
    "RolloutState",
    "TransformerView",
    "VllmOmniEngineClosedError",
    "VllmOmniEngineError",
    "VllmOmniRequestError",
    "VllmOmniRollout",
    "VllmOmniUnavailableError",
    "advance_request",
    "batch_experts",
    "batch_noise_pred",
    "build_requests",
    "check_engine_config",
    "check_engine_settings",
    "check_sampling_params",
    "collect_trajectories",
    "decode_request",
    "decode_wave",
    "engine_kwargs",
    "finish_request",
    "order_by_sample_index",
    "output_envelope",
    "require_vllm_omni",
    "resolve_window",
    "rollout",
    "run_request_wave",
    "sampling_params_kwargs",
    "start_request",
    "trajectory_from_payload",
    "trajectory_to_payload",
    "vllm_omni_available",
]
