# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The engine client: start a vLLM-omni engine on the rollout pipeline and sample batches on it.

[`VllmOmniRollout`] starts `vllm_omni.Omni` (the offline API) with [`engine_kwargs`], sends each batch as the
prompt dicts of `build_requests` (`protocol`) with [`sampling_params_kwargs`], and returns the trajectories
stacked in request order ([`collect_trajectories`], which checks that each is the rollout that was asked
for). Only this module imports vLLM-omni on the client side, inside `VllmOmniRollout` and after
`require_vllm_omni` (`errors`). A failed request raises `VllmOmniRequestError` and leaves the engine closed
(vLLM-omni 0.30 shuts it down); [`rollout`] is the guard for callers that have no engine.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rollout_consistency.adapters.families import ModelFamily, get_family
from rollout_consistency.adapters.settings import BatchRequests, SamplingSettings
from rollout_consistency.adapters.trajectory import Trajectory, TrajectoryFormatError, stack_trajectories
from rollout_consistency.schedulers import SchedulerSetup, SDEWindowSchedule

from .envelope import order_by_sample_index, trajectory_from_payload
from .errors import VllmOmniEngineClosedError, VllmOmniRequestError, require_vllm_omni
from .protocol import PAYLOAD_KEY, PIPELINE_CLASS, PIPELINE_CLASSES, RequestSettings, build_requests

#: The families `VllmOmniRollout` (the checker's `vllm-omni` backend) serves; Wan's pipeline is driven through
#: `engine_kwargs(pipeline_class=PIPELINE_CLASSES["wan"])` and `build_requests(model_family="wan")`.
CLIENT_FAMILIES = ("qwen-image",)

__all__ = [
    "ENGINE_DTYPES",
    "VllmOmniRollout",
    "collect_trajectories",
    "engine_kwargs",
    "rollout",
    "sampling_params_kwargs",
]

#: The transformer dtypes the engine may run (vLLM-omni falls back to bf16 on any other name, silently).
ENGINE_DTYPES = ("bfloat16", "float16", "float32")


def engine_kwargs(
    *,
    dtype: str = "bfloat16",
    step_execution: bool = False,
    max_num_seqs: int = 1,
    enforce_eager: bool = True,
    attention_backend: str | None = None,
    request_batch_max_wait_ms: float | None = None,
    engine_options: Mapping[str, Any] | None = None,
    pipeline_class: str = PIPELINE_CLASS,
) -> dict[str, Any]:
    """Keyword arguments of `vllm_omni.Omni(model, **kwargs)` for the rollout pipeline.

    Args:
        dtype: the transformer's dtype (`rollout_dtype`): `"bfloat16"`, `"float16"` or `"float32"` (vLLM-omni
            silently falls back to bf16 on an unknown name, so it is checked here).
        step_execution: step-batch mode (continuous batching) instead of request batches.
        max_num_seqs: requests per batch (both modes).
        enforce_eager: `False` lets vLLM-omni `torch.compile` the transformer (the trainer runs eager).
        attention_backend: vLLM-omni's attention backend name (e.g. `"TORCH_SDPA"`, `"FLASH_ATTN"`), default the
            platform's.
        request_batch_max_wait_ms: request mode: how long a wave waits to fill; default 1000 ms when
            `max_num_seqs > 1` (all requests of a call then batch together), else 0.
        engine_options: any other `OmniDiffusionConfig` field (Wan 2.2: `boundary_ratio`); may not replace the
            pipeline class.
        pipeline_class: the rollout pipeline vLLM-omni loads (`protocol.PIPELINE_CLASSES[model_family]`; default
            Qwen-Image's).
    """
    if pipeline_class not in PIPELINE_CLASSES.values():
        raise ValueError(f"pipeline_class {pipeline_class!r} is not one of {sorted(PIPELINE_CLASSES.values())}.")
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"vLLM-omni dtype {dtype!r} is not one of {ENGINE_DTYPES}.")
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}.")
    if request_batch_max_wait_ms is None:
        request_batch_max_wait_ms = 1000.0 if max_num_seqs > 1 and not step_execution else 0.0
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "enforce_eager": bool(enforce_eager),
        "step_execution": bool(step_execution),
        "max_num_seqs": max_num_seqs,
        "request_batch_max_wait_ms": float(request_batch_max_wait_ms),
        "cache_backend": "none",
        "custom_pipeline_args": {"pipeline_class": pipeline_class},
    }
    if attention_backend is not None:
        kwargs["diffusion_attention_config"] = {"default": attention_backend}
    for name, value in dict(engine_options or {}).items():
        if name == "custom_pipeline_args":
            value = dict(value)
            if value.get("pipeline_class", pipeline_class) != pipeline_class:
                raise ValueError(
                    f"engine_options would replace the pipeline class {pipeline_class!r} with "
                    f"{value['pipeline_class']!r}; trajectories come only from that class."
                )
            value["pipeline_class"] = pipeline_class
        kwargs[name] = value
    return kwargs


def sampling_params_kwargs(
    *,
    scheduler_setup: SchedulerSetup,
    options: Mapping[str, Any],
    guidance_scale: float,
    extra_args: Mapping[str, Any],
    launcher_seed: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments of `vllm_omni.inputs.data.OmniDiffusionSamplingParams` for one `generate` call.

    The batch-wide settings travel in `extra_args` ([`build_requests`]); the plain fields repeat what the
    pipeline checks them against (`num_inference_steps`, `height`, `width`, `true_cfg_scale`).
    """
    return {
        # An explicit seed keeps vLLM-omni from drawing one with `random` (the pipeline draws from ours).
        "seed": 0 if launcher_seed is None else launcher_seed,
        "num_inference_steps": scheduler_setup.num_inference_steps,
        "height": int(options["height"]),
        "width": int(options["width"]),
        "true_cfg_scale": float(guidance_scale),
        "num_outputs_per_prompt": 1,
        "extra_args": dict(extra_args),
    }


def _close_engine(omni: Any) -> None:
    omni.close()


def _name_failed_requests(error_text: str, sent: Sequence[Mapping[str, Any]]) -> str:
    """`error_text` with the sample it names (the pipeline prefixes `request {id}`; ids are `"{i}_{uuid}"`)."""
    for word in str(error_text).replace(":", " ").split():
        prefix = word.split("_", 1)[0]
        if "_" in word and prefix.isdigit() and int(prefix) < len(sent):
            request = sent[int(prefix)]["additional_information"][PAYLOAD_KEY]["request"]
            return f"sample {request['sample_index']} (seed {request['seed']}, request {word}): {error_text}"
    return f"request(s) of this call: {error_text}"


class VllmOmniRollout:
    """A vLLM-omni engine (`vllm_omni.Omni`, offline API) serving [`PIPELINE_CLASS`], and its rollout call.

    Starting one loads the model directory into vLLM-omni (minutes for a full-size model); keep it for many
    [`rollout`](#rollout) calls and [`close`] it (or use it as a context manager). Needs vLLM-omni, vLLM and
    CUDA: without them the constructor raises [`VllmOmniUnavailableError`] naming the extra to install.

    Args:
        model_path: a local diffusers Qwen-Image directory (`model_index.json`, `transformer/`, `text_encoder/`,
            `tokenizer/`, `vae/`, `scheduler/`). The trainer must load the same weights.
        launcher_seed, window_schedule: sent with every request so the engine re-derives each SDE window from
            (launcher seed, global step, prompt group) and checks it against the explicit one.
        text_width: the width every forward pads text to (default: each call's conditioning width; see
            `build_requests`).
        engine: an engine already started on `model_path` with [`engine_kwargs`] (anything with vLLM-omni's
            `generate(prompts, sampling_params, use_tqdm=...)` and `close()`), used instead of starting one.
        **engine_args: the engine's arguments, passed to [`engine_kwargs`] (`dtype`, `step_execution`,
            `max_num_seqs`, `enforce_eager`, `attention_backend`, `request_batch_max_wait_ms`, `engine_options`).

    A failed request raises [`VllmOmniRequestError`] naming it. vLLM-omni shuts the engine down when a request
    fails, so from then on every call raises [`VllmOmniEngineClosedError`]: start a new `VllmOmniRollout`.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        launcher_seed: int | None = None,
        window_schedule: SDEWindowSchedule | None = None,
        text_width: int | None = None,
        engine: Any = None,
        **engine_args: Any,
    ):
        kwargs = engine_kwargs(**engine_args)
        path = Path(model_path)
        if not (path / "model_index.json").is_file():
            raise FileNotFoundError(
                f"{path} is not a diffusers model directory (no model_index.json); vLLM-omni loads Qwen-Image from a "
                f"local directory with transformer/, text_encoder/, tokenizer/, vae/ and scheduler/."
            )
        if engine is None:
            require_vllm_omni()
            from vllm_omni import Omni  # the only import of vLLM-omni on the client side

            engine = Omni(model=str(path), **kwargs)
        self.model_path = str(path)
        self.step_execution = kwargs["step_execution"]
        self.max_num_seqs = kwargs["max_num_seqs"]
        self.launcher_seed = launcher_seed
        self.window_schedule = window_schedule
        self.text_width = text_width
        self.engine_kwargs = kwargs
        self._omni = engine
        self._finalizer = weakref.finalize(self, _close_engine, self._omni)
        self._closed_by: str | None = None  # why the engine is closed; None while it serves

    def __enter__(self) -> VllmOmniRollout:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Shut the engine down (idempotent); later calls raise [`VllmOmniEngineClosedError`]."""
        if self._closed_by is None:
            self._closed_by = "it was closed (VllmOmniRollout.close)"
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed_by is not None

    def rollout(
        self,
        family: ModelFamily | None,
        transformer: Any,
        conditioning: Mapping[str, torch.Tensor] | None,
        *,
        scheduler_setup: SchedulerSetup,
        requests: BatchRequests,
        sampling: SamplingSettings,
        options: Mapping[str, Any],
    ) -> Trajectory:
        """Sample a batch on the engine: the same arguments as `rollout_consistency.adapters.rollout`, the same float32 [`Trajectory`].

        Rows are in the order of `requests.seeds` (completion order is mapped back). `transformer` is accepted for
        signature compatibility and unused: the engine holds its own copy of the weights from `model_path`.
        `conditioning` may be a `PromptTexts` instead of embeddings (see `build_requests`). The engine always
        denoises to the end (`requests.denoise_to_end` is not needed: the final latents come back too).

        Raises:
            ValueError: bad settings (before anything is sent).
            VllmOmniRequestError: a request failed in the engine (the engine is closed after it).
            VllmOmniEngineClosedError: the engine was closed before this call.
            TrajectoryFormatError: a request returned no valid trajectory.
        """
        if self._closed_by is not None:
            raise VllmOmniEngineClosedError(
                f"The vLLM-omni engine on {self.model_path} is closed: {self._closed_by}. Start a new VllmOmniRollout."
            )
        if family is not None and family.name not in CLIENT_FAMILIES:
            raise ValueError(
                f"model family {family.name!r} has no vLLM-omni pipeline (have: {', '.join(CLIENT_FAMILIES)})."
            )
        request_prompts, extra_args = build_requests(
            conditioning,
            scheduler_setup=scheduler_setup,
            requests=requests
            if self.launcher_seed is None
            else dataclasses.replace(requests, launcher_seed=self.launcher_seed),
            sampling=sampling,
            options=options,
            text_width=self.text_width,
            window_schedule=self.window_schedule,
        )
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        params = OmniDiffusionSamplingParams(
            **sampling_params_kwargs(
                scheduler_setup=scheduler_setup,
                options=options,
                guidance_scale=sampling.guidance_scale,
                extra_args=extra_args,
                launcher_seed=self.launcher_seed,
            )
        )
        try:
            outputs = self._omni.generate(request_prompts, params, use_tqdm=False)
        except Exception as error:
            # vLLM-omni 0.30's Omni.generate raises a failed request's error (vLLM's EngineGenerateError, not a
            # per-output `error`) and closes the engine before re-raising: never hand that engine out again.
            failure = _name_failed_requests(str(error), request_prompts)
            self._closed_by = f"vLLM-omni shut it down after a failed request, {failure}"
            self.close()
            raise VllmOmniRequestError(
                f"vLLM-omni request failed, {failure} ({type(error).__name__}); the engine is closed."
            ) from error
        items = []
        for output in outputs:
            if getattr(output, "error", None):  # an engine that reports per-output errors instead of raising
                raise VllmOmniRequestError(
                    f"vLLM-omni request failed, {_name_failed_requests(f'{output.request_id}: {output.error}', request_prompts)}"
                )
            trajectory = (output.multimodal_output or {}).get("trajectory")
            if trajectory is None:
                raise TrajectoryFormatError(
                    f"vLLM-omni output {output.request_id} carries no trajectory: the engine did not run "
                    f"{PIPELINE_CLASS} (check custom_pipeline_args)."
                )
            items.append((output.request_id, trajectory))
        payloads = order_by_sample_index(items, len(request_prompts))
        return collect_trajectories(payloads, request_prompts)


def collect_trajectories(payloads: Sequence[Mapping[str, Any]], sent: Sequence[Mapping[str, Any]]) -> Trajectory:
    """Rebuild each request's trajectory, check it is the rollout that was asked for, and stack them in order.

    Raises:
        ValueError: a returned trajectory's seed, prompt group, window or global step differs from its request.
    """
    trajectories = []
    for payload, prompt in zip(payloads, sent, strict=True):
        asked = RequestSettings.from_payload(prompt["additional_information"][PAYLOAD_KEY]["request"])
        trajectory = trajectory_from_payload(payload)
        got = (trajectory.seeds, trajectory.prompt_groups, trajectory.global_step)
        want = ((asked.seed,), (asked.prompt_group,), asked.global_step)
        if got != want or (asked.window is not None and trajectory.windows != (asked.window,)):
            raise ValueError(
                f"Sample {asked.sample_index}: the engine returned seeds/groups/step {got}, windows {trajectory.windows} "
                f"for a request of {want}, window {asked.window}."
            )
        trajectories.append(trajectory)
    family = get_family(trajectories[0].model_family) if trajectories else None
    return stack_trajectories(trajectories, family).validate()


def rollout(family: ModelFamily | None, transformer: Any, conditioning: Any, **kwargs: Any) -> Trajectory:
    """Module-level guard for callers that select this module as a rollout engine without starting one.

    A vLLM-omni rollout needs a running engine (a model directory, minutes to load): start a
    [`VllmOmniRollout`] once and call its `rollout` method. Raises [`VllmOmniUnavailableError`] (naming the extra
    to install) when vLLM-omni is absent, else ValueError saying how to start the engine.
    """
    require_vllm_omni()
    raise ValueError(
        "rollout_consistency.adapters.vllm_omni.rollout needs a started engine: use VllmOmniRollout(model_path, ...).rollout(...) "
        "(the checker builds it from its config in rollout_consistency.gate.sides.vllm_omni_rollout)."
    )
