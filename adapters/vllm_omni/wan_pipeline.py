# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""vLLM-omni's Wan 2.2 pipeline with float32 SDE rollouts and trajectories (vLLM-omni 0.30.0), request mode.

Imports `vllm` / `vllm_omni` at import time; nothing imports it but vLLM-omni itself, through the qualified name
`protocol.PIPELINE_CLASSES["wan"]` in `custom_pipeline_args`::

    Omni(model=path, **engine_kwargs(pipeline_class=PIPELINE_CLASSES["wan"], engine_options={"boundary_ratio": 0.875}))

with requests from `build_requests(..., model_family="wan")`. Like the Qwen-Image class, it is a thin shell over
the plain functions of `rollout_consistency.adapters.vllm_omni` (decode, start, one batched forward, one float32
step per request, finish) and the Wan family's velocity (`rollout_consistency.adapters.wan`), run on vLLM-omni's
own `WanTransformer3DModel` experts: each request owns a float32 latent, a CPU generator seeded with its seed and
our SDE scheduler; the experts are chosen per row by `WanExperts` (`t >= boundary_ratio · 1000`: `transformer`),
and every window step records the expert that took it, so the trainer's `experts` guard compares the switch.

What differs from the stock `Wan22Pipeline`: the stock loop steps a UniPC (or Euler) scheduler in the model dtype
and returns the video only. Request mode only (`supports_step_execution` is off, as on the stock class); the
prompt embeddings are sent by the client (the trainer's own, fixed width; a request with texts only is refused).
vLLM-omni's Wan post-process (video encoding) is not part of the rollout: the decoded video travels in the
envelope's `image` field beside the trajectory.
"""

from __future__ import annotations

import json
import os
from typing import Any, ClassVar

import torch
import vllm_omni
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.models.wan2_2.pipeline_wan2_2 import Wan22Pipeline
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

from rollout_consistency.adapters.wan import WanExperts

from . import engine_checks, envelope, protocol, worker
from .pipeline import failed_output

__all__ = ["RolloutWanPipeline"]


class RolloutWanPipeline(Wan22Pipeline):
    """`Wan22Pipeline` whose requests are float32 SDE rollouts returning rollout-consistency trajectories.

    Built by vLLM-omni's loader as `RolloutWanPipeline(od_config=...)`; loads the stock components and weights
    (one or two experts). Two experts need a `boundary_ratio`: the engine's (`OmniDiffusionConfig.boundary_ratio`),
    else the model directory's `model_index.json`.
    """

    supports_request_batch: ClassVar[bool] = True

    def __init__(self, *, od_config: OmniDiffusionConfig, prefix: str = "") -> None:
        super().__init__(od_config=od_config, prefix=prefix)
        engine_checks.check_engine_config(od_config)
        if self.expand_timesteps:
            raise ValueError("The Wan rollout pipeline serves text-to-video (expand_timesteps off); this is TI2V.")
        self._boundary_ratio = _boundary_ratio(od_config) if self.transformer_2 is not None else None
        if self.transformer_2 is not None and self._boundary_ratio is None:
            raise ValueError(
                f"{od_config.model} holds two experts but no boundary_ratio (engine or model_index.json): start the "
                f"engine with boundary_ratio (Wan2.2-T2V-A14B: 0.875)."
            )

    @property
    def rollout_model(self) -> Any:
        """What the Wan family's functions run: the one expert, or both as `WanExperts` (not a submodule: the
        weights stay registered once, under the stock names)."""
        if self.transformer_2 is None:
            return self.transformer
        return WanExperts(self.transformer, self.transformer_2, self._boundary_ratio)

    def _decode(self, request: OmniDiffusionRequest) -> protocol.RolloutRequest | None:
        sampling = request.sampling_params
        decoded = protocol.decode_request(
            request.prompt,
            sampling.extra_args,
            allow_missing=OmniDiffusionRequest.is_dummy_run_request_id(request.request_id),
        )
        if decoded is None:
            return None
        if decoded.batch.model_family != "wan":
            raise ValueError(f"This engine serves Wan; the request is for {decoded.batch.model_family!r}.")
        if decoded.conditioning is None:
            raise ValueError("Send prompt_embeds (build_requests with conditioning): this pipeline encodes no text.")
        options = decoded.batch.options
        for name, value in (("height", sampling.height), ("width", sampling.width)):
            if value is not None and value != options[name]:
                raise ValueError(f"sampling_params.{name}={value} but the request's settings say {options[name]}.")
        if sampling.num_inference_steps not in (None, decoded.batch.scheduler.num_inference_steps):
            raise ValueError(
                f"sampling_params.num_inference_steps={sampling.num_inference_steps} but the request's schedule has "
                f"{decoded.batch.scheduler.num_inference_steps}."
            )
        if sampling.latents is not None:
            raise ValueError(
                "sampling_params.latents is set: the pipeline draws the initial noise from the request's seed."
            )
        return decoded

    def _finish(self, rollout: worker.RolloutState) -> DiffusionOutput:
        trajectory = worker.finish_request(rollout)
        latents = rollout.state.latents.to(self.vae.dtype)  # a copy for the VAE; the stored latents stay float32
        config = self.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
        std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
        video = self.vae.decode(latents * std + mean, return_dict=False)[0]
        payload = envelope.trajectory_to_payload(trajectory, rollout.request.request)
        return DiffusionOutput(output=envelope.output_envelope(video, payload))

    _failed = staticmethod(failed_output)

    def forward(self, req: DiffusionRequestBatch) -> list[DiffusionOutput]:
        """A wave of requests stepped together: one forward per step over the running requests, one float32
        scheduler step each (recorded with its expert inside the window), one output each:
        `rollout_consistency.adapters.vllm_omni.worker.run_request_wave`."""
        decoded = worker.decode_wave(req.requests, self._decode)
        if all(d is None for d in decoded):  # vLLM-omni's warm-up request
            return super().forward(req)
        model = self.rollout_model
        provenance = {"execution": "request", "vllm_omni": str(vllm_omni.__version__)}
        return worker.run_request_wave(
            model,
            [request.request_id for request in req.requests],
            decoded,
            start=lambda _index, item: worker.start_request(
                item, item.conditioning, model, device=self.device, provenance=provenance
            ),
            finish=self._finish,
            failed=self._failed,
        )


def _boundary_ratio(od_config: OmniDiffusionConfig) -> float | None:
    if od_config.boundary_ratio is not None:
        return float(od_config.boundary_ratio)
    index = os.path.join(str(od_config.model), "model_index.json")
    if not os.path.isfile(index):
        return None
    with open(index) as handle:
        value = json.load(handle).get("boundary_ratio")
    return None if value is None else float(value)
