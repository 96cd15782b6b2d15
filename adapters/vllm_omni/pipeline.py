# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""vLLM-omni's Qwen-Image pipeline with float32 SDE rollouts and trajectories (vLLM-omni 0.30.0).

The only module of this project that imports `vllm` / `vllm_omni` at import time. Nothing imports it but
vLLM-omni itself, through the qualified name in `custom_pipeline_args`::

    Omni(model=path, custom_pipeline_args={"pipeline_class": "rollout_consistency.adapters.vllm_omni.pipeline.RolloutQwenImagePipeline"},
         enforce_eager=True, step_execution=..., max_num_seqs=...)

(`rollout_consistency.adapters.vllm_omni.VllmOmniRollout` does exactly that.) The worker re-imports the class, so this package
must be installed in the engine's environment.

The class is a thin shell: every computation is a plain function of `rollout_consistency.adapters.vllm_omni`, shared with the
PyTorch step-wise path and tested on the CPU there. It implements both of vLLM-omni's execution modes with
one code path:

* step mode (`step_execution=True`): `prepare_encode` → `denoise_step` (one forward over the running
  requests, which may be at different steps) → `step_scheduler` (per request) → `post_decode`;
* request mode: `forward(req)` runs the same four methods' logic over the wave's requests.

What differs from the stock `QwenImagePipeline`: each request owns a float32 latent, a CPU generator
seeded with its own seed, and our SDE scheduler (`sample_previous_step`); the forward casts the latents to
the transformer dtype only for the call and returns float32; text is padded by our shared function and the
RoPE length is the padded width; CFG is combined in float32 (as the trainer does); and `post_decode`
returns the trajectory in the output envelope. Requests without our settings are refused (ValueError),
except vLLM-omni's own warm-up request, which takes the stock path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import vllm_omni
from vllm_omni.diffusion.data import DiffusionOutput, OmniDiffusionConfig
from vllm_omni.diffusion.models.qwen_image import QwenImagePipeline
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.input_batch import InputBatch
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.diffusion.worker.utils import StepRequestState

from rollout_consistency.adapters import vllm_omni as rc

__all__ = ["RolloutQwenImagePipeline", "failed_output"]


def failed_output(request_id: str, error: BaseException) -> DiffusionOutput:
    """A failed request's output. The request id leads the error text: vLLM-omni's client raises the text alone,
    and the id's "{i}_" prefix is how the client names the failed sample (`vllm_omni.client`)."""
    output = DiffusionOutput.from_exception(error)
    output.error = f"request {request_id}: {output.error}"
    return output


class RolloutQwenImagePipeline(QwenImagePipeline):
    """`QwenImagePipeline` whose requests are float32 SDE rollouts returning rollout-consistency trajectories.

    Built by vLLM-omni's loader as `RolloutQwenImagePipeline(od_config=...)`; loads the same components and
    weights as the stock class (only the transformer has weights to load; nothing is added under it).
    """

    supports_request_batch: ClassVar[bool] = True
    supports_step_execution: ClassVar[bool] = True

    def __init__(self, *, od_config: OmniDiffusionConfig, prefix: str = "") -> None:
        super().__init__(od_config=od_config, prefix=prefix)
        rc.check_engine_config(
            od_config,
            guidance_embeds=bool(self.transformer.guidance_embeds),
            zero_cond_t=bool(getattr(self.transformer, "zero_cond_t", False)),
        )
        # Set by the stock `_prepare_generation_context`, which our requests never call; `denoise_step` reads them.
        self._interrupt = False
        self._attention_kwargs: dict[str, Any] = {}
        self._current_timestep = None
        self._view = rc.TransformerView(
            self.transformer,
            in_channels=int(self.transformer.in_channels),
            joint_attention_dim=int(self.transformer.txt_norm.normalized_shape[0]),
        )

    # ------------------------------------------------------------------------------------ helpers
    def _decode(self, request_id: str, prompt: Any, sampling: Any) -> rc.RolloutRequest | None:
        request = rc.decode_request(
            prompt, sampling.extra_args, allow_missing=OmniDiffusionRequest.is_dummy_run_request_id(request_id)
        )
        if request is not None:
            rc.check_sampling_params(
                request,
                num_inference_steps=sampling.num_inference_steps,
                height=sampling.height,
                width=sampling.width,
                num_outputs_per_prompt=sampling.num_outputs_per_prompt,
                has_latents=sampling.latents is not None,
                has_custom_schedule=sampling.sigmas is not None or sampling.timesteps is not None,
                vae_scale_factor=self.vae_scale_factor,
            )
        return request

    def _encode_text(self, request: rc.RolloutRequest, sampling: Any) -> dict[str, torch.Tensor]:
        """The engine's own text embeddings when the client sent texts, float32 (what the trajectory stores)."""
        if not request.text:
            raise ValueError("The request has neither prompt_embeds nor a prompt text to encode.")
        max_length = sampling.max_sequence_length or self.tokenizer_max_length
        texts = {"": request.text}
        if request.batch.guidance_scale > 1:
            if request.negative_text is None:
                raise ValueError(
                    f"True CFG is on (guidance_scale={request.batch.guidance_scale}) but the request has no "
                    f"negative_prompt; send one (' ' is fine) or set guidance_scale <= 1."
                )
            texts["negative_"] = request.negative_text
        conditioning = {}
        for prefix, text in texts.items():
            embeds, mask = self.encode_prompt(
                prompt=text, max_sequence_length=max_length, prompt_name=f"{prefix}prompt"
            )
            conditioning[f"{prefix}prompt_embeds"] = embeds.float()
            conditioning[f"{prefix}prompt_embeds_mask"] = mask.long()
        return conditioning

    def _start(self, request: rc.RolloutRequest, sampling: Any, execution: str) -> rc.RolloutState:
        conditioning = request.conditioning
        if conditioning is None:
            conditioning = self._encode_text(request, sampling)
        return rc.start_request(
            request,
            conditioning,
            self._view,
            device=self.device,
            provenance={"execution": execution, "vllm_omni": str(vllm_omni.__version__)},
        )

    def _finish(self, rollout: rc.RolloutState) -> DiffusionOutput:
        trajectory = rc.finish_request(rollout)
        options = rollout.request.batch.options
        # _decode_latents casts a copy to the VAE dtype; the stored latents stay float32.
        image = self._decode_latents(rollout.state.latents, int(options["height"]), int(options["width"]), "pil").output
        payload = rc.trajectory_to_payload(trajectory, rollout.request.request)
        return DiffusionOutput(output=rc.output_envelope(image, payload))

    _failed = staticmethod(failed_output)

    @staticmethod
    def _mirror(state: StepRequestState, rollout: rc.RolloutState) -> None:
        # vLLM-omni's runner gathers `state.latents` (and checks their dtype), reads `state.step_index` for
        # completion: keep them the very tensors / values of our per-request state.
        state.latents = rollout.state.latents
        state.step_index = rollout.state.step_index

    # ------------------------------------------------------------------------------ step protocol
    def prepare_encode(self, state: StepRequestState, **kwargs: Any) -> StepRequestState:
        """Decode the request's settings, draw its float32 initial latents, give it its own scheduler."""
        try:
            request = self._decode(state.request_id, state.prompt, state.sampling)
        except ValueError as error:  # the runner reports it as this request's error; name the request in it
            raise ValueError(f"request {state.request_id}: {error}") from error
        if request is None:  # vLLM-omni's warm-up request: stock behaviour, no trajectory
            return super().prepare_encode(state, **kwargs)
        rollout = self._start(request, state.sampling, "step")
        state.extra[rc.PAYLOAD_KEY] = rollout
        state.timesteps = rollout.state.scheduler.timesteps
        state.scheduler = rollout.state.scheduler
        state.do_true_cfg = request.batch.guidance_scale > 1
        state.sampling.cfg_normalize = True  # as the stock pipeline: part of the step-batch key
        # prompt_embeds stay None on the vLLM state: the text is padded by our shared function at each forward
        # (vLLM-omni's InputBatch would pad it to the longest *valid* prompt of the running requests instead).
        self._mirror(state, rollout)
        return state

    def denoise_step(
        self, input_batch: InputBatch, *, states: Sequence[StepRequestState] | None = None, **kwargs: Any
    ) -> torch.Tensor | None:
        """One forward over the running requests: float32 noise_pred, rows in `states` order."""
        states = list(states if states is not None else input_batch.states)
        rollouts = [s.extra.get(rc.PAYLOAD_KEY) for s in states]
        if all(r is None for r in rollouts):
            return super().denoise_step(input_batch, **kwargs)
        if any(r is None for r in rollouts):
            raise ValueError(
                "A step batch mixes rollout-consistency requests with plain ones; this pipeline serves rollouts only."
            )
        return rc.batch_noise_pred(self._view, rollouts)

    def step_scheduler(self, state: StepRequestState, noise_pred: torch.Tensor, **kwargs: Any) -> None:
        """One float32 SDE/ODE step of one request (recorded inside its window)."""
        rollout = state.extra.get(rc.PAYLOAD_KEY)
        if rollout is None:
            return super().step_scheduler(state, noise_pred, **kwargs)
        rc.advance_request(rollout, noise_pred)
        self._mirror(state, rollout)
        return None

    def post_decode(self, state: StepRequestState, **kwargs: Any) -> DiffusionOutput:
        """The decoded image and the request's trajectory, in vLLM-omni's output envelope."""
        rollout = state.extra.get(rc.PAYLOAD_KEY)
        if rollout is None:
            return super().post_decode(state, **kwargs)
        self._current_timestep = None
        return self._finish(rollout)

    # ------------------------------------------------------------------------------- request mode
    def forward(self, req: DiffusionRequestBatch) -> list[DiffusionOutput]:
        """A wave of requests, stepped together through the same functions as step mode (one output each):
        `rollout_consistency.adapters.vllm_omni.worker.run_request_wave`."""
        decoded = rc.decode_wave(req.requests, lambda r: self._decode(r.request_id, r.prompt, r.sampling_params))
        if all(d is None for d in decoded):  # vLLM-omni's warm-up request
            return super().forward(req)
        return rc.run_request_wave(
            self._view,
            [request.request_id for request in req.requests],
            decoded,
            start=lambda index, item: self._start(item, req.requests[index].sampling_params, "request"),
            finish=self._finish,
            failed=self._failed,
        )
