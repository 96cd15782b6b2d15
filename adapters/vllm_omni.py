# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The vLLM-omni rollout backend: request settings, per-request engine state, trajectory envelope, engine client.

Written against vLLM-omni 0.30.0 (`VLLM_OMNI_VERSION`). This module never imports vllm or vllm_omni at
import time; only [`VllmOmniRollout`] does, when it starts an engine, and without the package it raises
[`VllmOmniUnavailableError`] naming the extra to install. The pipeline class that vLLM-omni's worker
loads lives in `rollout_consistency.adapters.vllm_omni_pipeline` (the only module that imports vLLM at its top); it is a thin
shell over the plain functions here, which are tested on the CPU with the diffusers transformer.

Data flow (docs/vllm-omni.md)::

    client (this process)                          vLLM-omni worker (rollout_consistency.adapters.vllm_omni_pipeline)
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

import importlib.util
import math
import os
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollout_consistency.schedulers import SDE_TYPES, SchedulerSetup, SDEWindow, SDEWindowSchedule

from . import stepwise
from .families import ModelFamily, get_family
from .qwen_image import latent_grid
from .rollout import make_generators, resolve_windows
from .trajectory import Trajectory, TrajectoryFormatError, stack_trajectories

__all__ = [
    "ENVELOPE_FORMAT",
    "INSTALL_HINT",
    "PAYLOAD_KEY",
    "PAYLOAD_VERSION",
    "PIPELINE_CLASS",
    "VLLM_OMNI_VERSION",
    "BatchSettings",
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
    "batch_noise_pred",
    "build_requests",
    "check_engine_settings",
    "check_sampling_params",
    "collect_trajectories",
    "decode_request",
    "engine_kwargs",
    "finish_request",
    "order_by_sample_index",
    "output_envelope",
    "require_vllm_omni",
    "resolve_window",
    "rollout",
    "sampling_params_kwargs",
    "start_request",
    "trajectory_from_payload",
    "trajectory_to_payload",
    "vllm_omni_available",
]

#: Key of our block in `prompt["additional_information"]`, `sampling_params.extra_args` and `state.extra`.
PAYLOAD_KEY = "rollout_consistency"
PAYLOAD_VERSION = 1
#: `format` of the trajectory payload in the output envelope (and in its metadata group "trajectory").
ENVELOPE_FORMAT = "rollout-consistency/vllm-omni-trajectory"
#: `custom_pipeline_args["pipeline_class"]`: a qualified name, re-imported inside vLLM-omni's worker.
PIPELINE_CLASS = "rollout_consistency.adapters.vllm_omni_pipeline.RolloutQwenImagePipeline"
VLLM_OMNI_VERSION = "0.30.0"
INSTALL_HINT = (
    "pip install 'rollout-consistency[vllm]' (vllm-omni==0.30.0 with vllm==0.30.0) on a machine with an NVIDIA "
    "GPU and CUDA; see docs/vllm-omni.md"
)
ENGINE_DTYPES = ("bfloat16", "float16", "float32")
SUPPORTED_FAMILIES = ("qwen-image",)
_TEXT_FIELDS = ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask")
_BLOCK_KEYS = {"version", "batch", "request"}


# ------------------------------------------------------------------------------------------ availability
class VllmOmniUnavailableError(ImportError):
    """vLLM-omni (or vLLM, or CUDA) is missing where the `vllm-omni` backend is used. The message names the fix."""


class VllmOmniEngineError(RuntimeError):
    """The vLLM-omni engine could not serve a rollout call (base of the two errors below)."""


class VllmOmniRequestError(VllmOmniEngineError):
    """A request failed inside the engine. The message names the request (and its sample) and the engine's error.

    vLLM-omni 0.30's `Omni.generate` turns a failed request into an exception (vLLM's `EngineGenerateError`,
    or a client error) and shuts the whole engine down before raising, so the client that saw this error
    holds a closed engine; it refuses further calls ([`VllmOmniEngineClosedError`]).
    """


class VllmOmniEngineClosedError(VllmOmniEngineError):
    """The engine was closed (by [`VllmOmniRollout.close`], or by vLLM-omni after a failed request): start a new one."""


def vllm_omni_available() -> bool:
    """Whether `vllm_omni` and `vllm` are installed (found without importing them)."""
    return all(importlib.util.find_spec(name) is not None for name in ("vllm_omni", "vllm"))


def require_vllm_omni() -> None:
    """Raise [`VllmOmniUnavailableError`] unless vLLM-omni, vLLM and a CUDA device are present (imports nothing)."""
    missing = [name for name in ("vllm_omni", "vllm") if importlib.util.find_spec(name) is None]
    if missing:
        raise VllmOmniUnavailableError(
            f"The 'vllm-omni' rollout backend needs {' and '.join(missing)}, which is not installed: {INSTALL_HINT}."
        )
    if not torch.cuda.is_available():
        raise VllmOmniUnavailableError(
            "The 'vllm-omni' rollout backend needs a CUDA device (vLLM-omni 0.30 has no CPU attention backend); "
            "torch sees none. Run it on a GPU machine, or use rollout_backend 'torch' here."
        )


# ---------------------------------------------------------------------------------------------- settings
def _int(name: str, value: Any, minimum: int | None = None, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"rollout setting {name!r} must be an int, got {type(value).__name__} {value!r}.")
    if minimum is not None and value < minimum:
        raise ValueError(f"rollout setting {name!r} must be >= {minimum}, got {value}.")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"rollout setting {name!r} must be a finite number, got {value!r}.")
    return float(value)


def _mapping(name: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"rollout settings {name!r} must be a mapping, got {type(value).__name__}.")
    return value


def _exact_keys(name: str, data: Mapping[str, Any], required: Iterable[str], optional: Iterable[str] = ()) -> None:
    required, optional = set(required), set(optional)
    missing = sorted(required - set(data))
    unknown = sorted(set(data) - required - optional)
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise ValueError(
            f"rollout settings {name!r}: {', '.join(parts)}. Build them with rollout_consistency.adapters.vllm_omni.build_requests "
            f"(payload version {PAYLOAD_VERSION}) so the client and the engine agree."
        )


def _schedule_to_payload(schedule: SDEWindowSchedule) -> dict[str, Any]:
    return {
        "kind": schedule.kind,
        "num_steps": schedule.num_steps,
        "window_size": schedule.window_size,
        "window_range": None if schedule.window_range is None else list(schedule.window_range),
        "stride": schedule.stride,
        "every": schedule.every,
    }


def _schedule_from_payload(data: Any) -> SDEWindowSchedule:
    data = _mapping("window_schedule", data)
    _exact_keys("window_schedule", data, ("kind", "num_steps", "window_size", "window_range", "stride", "every"))
    window_range = data["window_range"]
    if window_range is not None:
        if not isinstance(window_range, (list, tuple)) or len(window_range) != 2:
            raise ValueError(f"window_schedule.window_range must be [low, high] or null, got {window_range!r}.")
        window_range = (_int("window_range[0]", window_range[0]), _int("window_range[1]", window_range[1]))
    return SDEWindowSchedule(
        kind=data["kind"],
        num_steps=_int("num_steps", data["num_steps"], 1),
        window_size=_int("window_size", data["window_size"], 1),
        window_range=window_range,
        stride=_int("stride", data["stride"], 1),
        every=_int("every", data["every"], 1),
    )


@dataclass(frozen=True)
class BatchSettings:
    """Settings shared by every request of one `generate` call (`sampling_params.extra_args[PAYLOAD_KEY]["batch"]`).

    Args:
        scheduler: the exact schedule ([`SchedulerSetup`]); the engine steps it, the trainer rebuilds it.
        noise_level, sde_type: the SDE step (`"sde"`, `"cps"`, `"dance_sde"`).
        guidance_scale: Qwen-Image true-CFG scale (vLLM-omni's `true_cfg_scale`); CFG runs when > 1 and then
            needs negative conditioning (an empty negative prompt `" "` is fine).
        options: the family options (`height`, `width`, `vae_scale_factor`, `mask_text_padding`).
        include_normalizer: Gaussian normaliser in the log-probs (cancels in ratios).
        text_width: the text width every forward pads to (`None`: the widest running request, as vLLM-omni's
            continuous batching does; a fixed width keeps every forward the computation the trainer repeats).
        window_schedule: the launcher's window rule; when set, the engine re-derives each request's window from
            (launcher seed, global step, prompt group) and checks it against an explicit one.
        model_family: only `"qwen-image"` has a vLLM-omni pipeline.
    """

    scheduler: SchedulerSetup
    noise_level: float
    sde_type: str
    guidance_scale: float
    options: Mapping[str, Any]
    include_normalizer: bool = True
    text_width: int | None = None
    window_schedule: SDEWindowSchedule | None = None
    model_family: str = "qwen-image"

    def __post_init__(self) -> None:
        if self.model_family not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"model family {self.model_family!r} has no vLLM-omni pipeline here (have: {', '.join(SUPPORTED_FAMILIES)}); "
                f"use rollout_backend 'torch' for it."
            )
        if not isinstance(self.scheduler, SchedulerSetup):
            raise TypeError(f"BatchSettings.scheduler must be a SchedulerSetup, got {type(self.scheduler).__name__}.")
        noise_level = _float("noise_level", self.noise_level)
        if noise_level <= 0:
            raise ValueError(f"noise_level must be > 0 for a rollout with log-probs, got {noise_level}.")
        if self.sde_type not in SDE_TYPES:
            raise ValueError(f"Unknown sde_type {self.sde_type!r}; expected one of {', '.join(SDE_TYPES)}.")
        object.__setattr__(self, "noise_level", noise_level)
        object.__setattr__(self, "guidance_scale", _float("guidance_scale", self.guidance_scale))
        options = dict(_mapping("options", self.options))
        latent_grid(options)  # height/width present and packable
        object.__setattr__(self, "options", options)
        if not isinstance(self.include_normalizer, bool):
            raise ValueError(f"include_normalizer must be a bool, got {self.include_normalizer!r}.")
        _int("text_width", self.text_width, 1, optional=True)
        if self.window_schedule is not None and self.window_schedule.num_steps != self.scheduler.num_inference_steps:
            raise ValueError(
                f"window_schedule is for {self.window_schedule.num_steps} steps but the schedule has "
                f"{self.scheduler.num_inference_steps}."
            )

    def to_payload(self) -> dict[str, Any]:
        """Plain, msgpack-able dict (ints, floats, strs, bools, lists, dicts)."""
        return {
            "model_family": self.model_family,
            "scheduler": self.scheduler.to_json_dict(),
            "noise_level": self.noise_level,
            "sde_type": self.sde_type,
            "guidance_scale": self.guidance_scale,
            "options": dict(self.options),
            "include_normalizer": self.include_normalizer,
            "text_width": self.text_width,
            "window_schedule": None if self.window_schedule is None else _schedule_to_payload(self.window_schedule),
        }

    @classmethod
    def from_payload(cls, data: Any) -> BatchSettings:
        data = _mapping("batch", data)
        _exact_keys(
            "batch",
            data,
            (
                "model_family",
                "scheduler",
                "noise_level",
                "sde_type",
                "guidance_scale",
                "options",
                "include_normalizer",
                "text_width",
                "window_schedule",
            ),
        )
        try:
            scheduler = SchedulerSetup.from_json_dict(_mapping("scheduler", data["scheduler"]))
        except (KeyError, TypeError) as error:
            raise ValueError(f"rollout setting 'scheduler' is malformed: {error}") from error
        schedule = data["window_schedule"]
        return cls(
            scheduler=scheduler,
            noise_level=data["noise_level"],
            sde_type=data["sde_type"],
            guidance_scale=data["guidance_scale"],
            options=data["options"],
            include_normalizer=data["include_normalizer"],
            text_width=data["text_width"],
            window_schedule=None if schedule is None else _schedule_from_payload(schedule),
            model_family=data["model_family"],
        )


@dataclass(frozen=True)
class RequestSettings:
    """Settings of one request (`prompt["additional_information"][PAYLOAD_KEY]["request"]`).

    Args:
        sample_index: the request's position in the client's list (maps completion order back).
        seed: the sample's seed (initial noise, then its SDE noise; `rollout_consistency.adapters.rollout`'s contract).
        prompt_group: its prompt group (rollouts of a group share a window).
        global_step: the training step.
        window: the explicit SDE window, or `None` to derive it from the batch's window schedule.
        launcher_seed: the launcher's seed (needed to derive the window; recorded otherwise).
    """

    sample_index: int
    seed: int
    prompt_group: int
    global_step: int
    window: SDEWindow | None = None
    launcher_seed: int | None = None

    def __post_init__(self) -> None:
        _int("sample_index", self.sample_index, 0)
        _int("seed", self.seed, -(2**63))
        _int("prompt_group", self.prompt_group, 0)
        _int("global_step", self.global_step, 0)
        _int("launcher_seed", self.launcher_seed, -(2**63), optional=True)
        if self.window is not None and not isinstance(self.window, SDEWindow):
            raise TypeError(f"RequestSettings.window must be an SDEWindow or None, got {self.window!r}.")

    def to_payload(self) -> dict[str, Any]:
        window = self.window
        return {
            "sample_index": self.sample_index,
            "seed": self.seed,
            "prompt_group": self.prompt_group,
            "global_step": self.global_step,
            "window": None if window is None else [window.start, window.size, window.num_steps],
            "launcher_seed": self.launcher_seed,
        }

    @classmethod
    def from_payload(cls, data: Any) -> RequestSettings:
        data = _mapping("request", data)
        _exact_keys("request", data, ("sample_index", "seed", "prompt_group", "global_step", "window", "launcher_seed"))
        window = data["window"]
        if window is not None:
            if not isinstance(window, (list, tuple)) or len(window) != 3:
                raise ValueError(f"rollout setting 'window' must be [start, size, num_steps] or null, got {window!r}.")
            window = SDEWindow(*(_int("window", v) for v in window))
        return cls(
            sample_index=data["sample_index"],
            seed=data["seed"],
            prompt_group=data["prompt_group"],
            global_step=data["global_step"],
            window=window,
            launcher_seed=data["launcher_seed"],
        )


@dataclass(frozen=True, eq=False)
class RolloutRequest:
    """One decoded request, as the engine sees it.

    Attributes:
        batch, request: the settings. window: the resolved SDE window ([`resolve_window`]).
        conditioning: batch-first Qwen-Image conditioning with one row (`prompt_embeds` (1, L, D) float32,
            `prompt_embeds_mask` (1, L) int64, negatives), or `None`: the engine encodes `text` itself.
        text, negative_text: the prompt texts, if sent.
    """

    batch: BatchSettings
    request: RequestSettings
    window: SDEWindow
    conditioning: Mapping[str, torch.Tensor] | None = None
    text: str | None = None
    negative_text: str | None = None


def resolve_window(batch: BatchSettings, request: RequestSettings) -> SDEWindow:
    """The request's SDE window: explicit, and/or derived from (launcher seed, global step, prompt group).

    Raises:
        ValueError: no window can be determined, the derived and explicit windows disagree (the client and
            the engine use different window rules), or the window does not fit the schedule.
    """
    derived = None
    if batch.window_schedule is not None:
        if request.launcher_seed is None:
            raise ValueError(
                "The batch sends a window_schedule but the request has no launcher_seed to derive its window from; "
                "send launcher_seed (the launcher's seed) with every request."
            )
        derived = batch.window_schedule.window(
            seed=request.launcher_seed, global_step=request.global_step, prompt_group=request.prompt_group
        )
    window = request.window if request.window is not None else derived
    if window is None:
        raise ValueError(
            "No SDE window for the request: send an explicit window, or launcher_seed with a batch window_schedule."
        )
    if derived is not None and window != derived:
        raise ValueError(
            f"Request {request.sample_index} (prompt group {request.prompt_group}) carries window {window} but "
            f"(launcher_seed={request.launcher_seed}, global_step={request.global_step}) with the batch's window "
            f"schedule gives {derived}: the client and the engine draw windows differently."
        )
    if window.num_steps != batch.scheduler.num_inference_steps:
        raise ValueError(
            f"Window {window} is for a {window.num_steps}-step schedule but the batch runs "
            f"{batch.scheduler.num_inference_steps} steps."
        )
    return window


def _conditioning_row(row: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One request's conditioning `{name: (1, ...)}` → the per-prompt tensors vLLM-omni's prompt dicts hold
    (`(L, D)`, `(L,)`), detached CPU copies (a view would drag its whole batch storage through the IPC)."""
    out = {}
    for name, tensor in row.items():
        if name not in _TEXT_FIELDS:
            raise ValueError(f"Unknown Qwen-Image conditioning key {name!r}; expected some of {list(_TEXT_FIELDS)}.")
        if tensor.dim() < 2 or tensor.shape[0] != 1:
            raise ValueError(f"conditioning[{name!r}] must hold one row (1, ...), got {tuple(tensor.shape)}.")
        out[name] = tensor[0].detach().to("cpu").clone()
    return out


def _prompt_field(prompt: Mapping[str, Any], name: str) -> Any:
    """`prompt[name]`, else `prompt["additional_information"][name]` (where vLLM-omni's
    `DiffusionRequestBatch.get_prompt_field` also looks)."""
    value = prompt.get(name)
    if value is None:
        info = prompt.get("additional_information")
        if isinstance(info, Mapping):
            value = info.get(name)
    return value


def _conditioning_from_prompt(prompt: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
    found = {name: _prompt_field(prompt, name) for name in _TEXT_FIELDS}
    found = {name: value for name, value in found.items() if value is not None}
    if not found:
        return None
    if "prompt_embeds" not in found:
        raise ValueError(f"The prompt carries {sorted(found)} but no 'prompt_embeds'.")
    out = {}
    for name, value in found.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"prompt[{name!r}] must be a tensor, got {type(value).__name__}.")
        per_prompt_dims = 1 if name.endswith("_mask") else 2
        if value.dim() == per_prompt_dims:
            value = value.unsqueeze(0)
        if value.dim() != per_prompt_dims + 1 or value.shape[0] != 1:
            raise ValueError(
                f"prompt[{name!r}] has shape {tuple(value.shape)}; send one prompt's tensor (L, D) / (L,)."
            )
        out[name] = value
    return out


def _block(container: Any, where: str) -> Mapping[str, Any] | None:
    if not isinstance(container, Mapping):
        return None
    block = container.get(PAYLOAD_KEY)
    if block is None:
        return None
    block = _mapping(f"{where}[{PAYLOAD_KEY!r}]", block)
    if block.get("version") != PAYLOAD_VERSION:
        raise ValueError(
            f"{where}[{PAYLOAD_KEY!r}] has payload version {block.get('version')!r}; this engine reads version "
            f"{PAYLOAD_VERSION}. Install the same rollout-consistency version on the client and the engine."
        )
    unknown = sorted(set(block) - _BLOCK_KEYS)
    if unknown:
        raise ValueError(f"{where}[{PAYLOAD_KEY!r}] has unknown keys {unknown}; expected {sorted(_BLOCK_KEYS)}.")
    return block


def decode_request(
    prompt: Any, extra_args: Mapping[str, Any] | None, *, allow_missing: bool = False
) -> RolloutRequest | None:
    """Read one request's settings from its prompt dict and its sampling params' `extra_args`.

    Each of `"batch"` and `"request"` is taken from the prompt's `additional_information[PAYLOAD_KEY]` first,
    then from `extra_args[PAYLOAD_KEY]` (so `Omni.generate`'s shared sampling params and `AsyncOmni`'s
    per-request ones both work); the same block in both places must be identical.

    Args:
        prompt: the request's prompt (`str` or dict, as vLLM-omni hands it to the pipeline).
        extra_args: `sampling_params.extra_args`.
        allow_missing: return `None` for a request with no settings at all (vLLM-omni's warm-up request only).

    Raises:
        ValueError: settings missing (unless `allow_missing`), malformed, of another payload version, or
            inconsistent — the engine refuses to sample a rollout it cannot account for.
    """
    prompt_map = prompt if isinstance(prompt, Mapping) else {}
    info = prompt_map.get("additional_information")
    blocks = [b for b in (_block(info, "prompt['additional_information']"), _block(extra_args, "extra_args")) if b]
    if not blocks:
        if allow_missing:
            return None
        raise ValueError(
            f"The request carries no {PAYLOAD_KEY!r} settings (in prompt['additional_information'] or "
            f"sampling_params.extra_args): this pipeline samples only rollouts it can record. Build requests with "
            f"rollout_consistency.adapters.vllm_omni.build_requests (docs/vllm-omni.md)."
        )
    parts = {}
    for part in ("batch", "request"):
        values = [b[part] for b in blocks if b.get(part) is not None]
        if not values:
            raise ValueError(f"The {PAYLOAD_KEY!r} settings have no {part!r} block; the client must send both.")
        if any(v != values[0] for v in values[1:]):
            raise ValueError(f"The {PAYLOAD_KEY!r} {part!r} block differs between the prompt and extra_args.")
        parts[part] = values[0]
    batch = BatchSettings.from_payload(parts["batch"])
    request = RequestSettings.from_payload(parts["request"])
    text, negative = prompt_map.get("prompt"), prompt_map.get("negative_prompt")
    if isinstance(prompt, str):
        text = prompt
    return RolloutRequest(
        batch=batch,
        request=request,
        window=resolve_window(batch, request),
        conditioning=_conditioning_from_prompt(prompt_map),
        text=text or None,
        negative_text=negative,
    )


def build_requests(
    conditioning: Mapping[str, torch.Tensor] | None,
    *,
    scheduler_setup: SchedulerSetup,
    seeds: Sequence[int],
    window: SDEWindow | Sequence[SDEWindow] | None,
    noise_level: float,
    sde_type: str = "sde",
    guidance_scale: float = 1.0,
    options: Mapping[str, Any],
    prompt_groups: Sequence[int] | None = None,
    global_step: int = 0,
    include_normalizer: bool = True,
    text_width: int | None = None,
    launcher_seed: int | None = None,
    window_schedule: SDEWindowSchedule | None = None,
    prompts: Sequence[str] | None = None,
    negative_prompts: Sequence[str] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The prompt dicts and the shared `extra_args` for one `Omni.generate` call.

    Args:
        conditioning: batch-first Qwen-Image conditioning (`prompt_embeds` (B, L, D) float32, masks int64, …);
            each request gets its row, so the engine runs the trainer's exact embeddings. `None`: send
            `prompts` (and `negative_prompts` for CFG) and let the engine's text encoder embed them (the
            trajectory then stores the engine's embeddings).
        seeds, window, prompt_groups, global_step: per sample, as for `rollout_consistency.adapters.rollout`; `window=None` sends no
            explicit window: the engine derives each from (launcher_seed, global_step, prompt group) with
            `window_schedule` (both then required).
        text_width: the shared text width of every forward; default: the conditioning's width (all rows
            padded alike, as the checker's step-wise torch path does), or `None` in text mode.
        launcher_seed, window_schedule: let the engine re-derive and check each window.
        Others: see [`BatchSettings`].

    Returns:
        `(prompts, extra_args)`: pass `extra_args` as `OmniDiffusionSamplingParams(extra_args=...)`.
    """
    seeds = list(seeds)
    if not seeds:
        raise ValueError("build_requests needs at least one sample (one seed per sample).")
    count = len(seeds)
    groups = list(range(count)) if prompt_groups is None else list(prompt_groups)
    if len(groups) != count:
        raise ValueError(f"{len(groups)} prompt groups for {count} seeds: pass one per sample.")
    if window is None:
        if window_schedule is None or launcher_seed is None:
            raise ValueError(
                "window=None needs window_schedule and launcher_seed: the engine derives each window from them."
            )
        windows: Sequence[SDEWindow | None] = [None] * count
    else:
        windows = resolve_windows(window, count, scheduler_setup.num_inference_steps)
    if conditioning is None and prompts is None:
        raise ValueError("Pass `conditioning` (embeddings) or `prompts` (texts for the engine's text encoder).")
    for name, texts in (("prompts", prompts), ("negative_prompts", negative_prompts)):
        if texts is not None and len(texts) != count:
            raise ValueError(f"{len(texts)} {name} for {count} seeds: pass one per sample.")
    rows = None
    if conditioning is not None:
        for name, tensor in conditioning.items():
            if tensor.shape[0] != count:
                raise ValueError(f"conditioning[{name!r}] has {tensor.shape[0]} rows for {count} seeds.")
        rows = [{k: v[i : i + 1] for k, v in conditioning.items()} for i in range(count)]
        if text_width is None:
            text_width = stepwise.shared_text_width(rows)
    batch = BatchSettings(
        scheduler=scheduler_setup,
        noise_level=noise_level,
        sde_type=sde_type,
        guidance_scale=guidance_scale,
        options=options,
        include_normalizer=include_normalizer,
        text_width=text_width,
        window_schedule=window_schedule,
    )
    request_prompts = []
    for index in range(count):
        request = RequestSettings(
            sample_index=index,
            seed=seeds[index],
            prompt_group=groups[index],
            global_step=global_step,
            window=windows[index],
            launcher_seed=launcher_seed,
        )
        resolve_window(batch, request)  # fail here, on the client, rather than in the engine
        prompt: dict[str, Any] = {
            "prompt": "" if prompts is None else prompts[index],
            "additional_information": {PAYLOAD_KEY: {"version": PAYLOAD_VERSION, "request": request.to_payload()}},
        }
        if negative_prompts is not None:
            prompt["negative_prompt"] = negative_prompts[index]
        if rows is not None:
            prompt.update(_conditioning_row(rows[index]))
        request_prompts.append(prompt)
    extra_args = {PAYLOAD_KEY: {"version": PAYLOAD_VERSION, "batch": batch.to_payload()}}
    return request_prompts, extra_args


# ---------------------------------------------------------------------------------- engine-side checks
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


# -------------------------------------------------------------------------------- per-request state
@dataclass(frozen=True)
class _ConfigView:
    in_channels: int
    joint_attention_dim: int


class TransformerView:
    """A transformer as the family functions see it: `.config.in_channels`, `.config.joint_attention_dim`,
    `.parameters()` and a call taking `txt_seq_lens`.

    vLLM-omni's `QwenImageTransformer2DModel` has no diffusers `.config`; this view lends it one (the module
    itself is not modified) so `rollout_consistency.adapters.qwen_image`'s velocity, initial-noise and conditioning checks run on
    it unchanged. Calls go straight to the module; `txt_seq_lens` is passed on only if the module takes it.
    """

    def __init__(self, module: nn.Module, *, in_channels: int, joint_attention_dim: int):
        from .rope import takes_txt_seq_lens

        self.module = module
        self.config = _ConfigView(int(in_channels), int(joint_attention_dim))
        self._passes_lengths = takes_txt_seq_lens(module)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def forward(self, *, txt_seq_lens: Sequence[int] | None = None, **kwargs: Any):
        if self._passes_lengths:
            kwargs["txt_seq_lens"] = txt_seq_lens
        return self.module(**kwargs)

    def __call__(self, **kwargs: Any):
        return self.forward(**kwargs)


@dataclass
class RolloutState:
    """The engine's state of one request (kept in vLLM-omni's `StepRequestState.extra[PAYLOAD_KEY]`).

    `state` is `rollout_consistency.adapters.stepwise.RequestState` — the PyTorch step-wise path's own per-request state — so
    both engines step, record and assemble trajectories with the same functions.
    """

    request: RolloutRequest
    state: stepwise.RequestState
    provenance: Mapping[str, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state.finished


def _family(batch: BatchSettings) -> ModelFamily:
    return get_family(batch.model_family)


def start_request(
    request: RolloutRequest,
    conditioning: Mapping[str, torch.Tensor],
    transformer: TransformerView | nn.Module,
    *,
    device: torch.device | str,
    provenance: Mapping[str, str] | None = None,
) -> RolloutState:
    """`prepare_encode`: the request's generator, float32 initial latents `(1, S, C)` and its own scheduler.

    Args:
        request: the decoded request.
        conditioning: its conditioning with one row (sent, or encoded by the engine).
        transformer: anything with `.config.in_channels` / `.config.joint_attention_dim` (a diffusers model,
            or a [`TransformerView`]).
        device: where the latents and conditioning live (the transformer's device).
    """
    batch = request.batch
    family = _family(batch)
    family.check_conditioning(transformer, conditioning, 1, batch.guidance_scale, batch.options)
    (generator,) = make_generators([request.request.seed])
    latents = family.initial_latents(transformer, [generator], batch.options).to(device=device, dtype=torch.float32)
    scheduler = batch.scheduler.build()
    step_request = stepwise.StepwiseRequest(
        request_id=f"sample-{request.request.sample_index}",
        seed=request.request.seed,
        conditioning={k: v.to(device) for k, v in conditioning.items()},
        window=request.window,
        prompt_group=request.request.prompt_group,
    )
    state = stepwise.RequestState(
        request=step_request,
        latents=latents,
        generator=generator,
        scheduler=scheduler,
        record=stepwise.init_window_record(request.window),
    )
    return RolloutState(request=request, state=state, provenance=dict(provenance or {}))


def _forward_settings(batch: BatchSettings) -> tuple:
    return (batch.model_family, batch.guidance_scale, tuple(sorted(batch.options.items())), batch.text_width)


def batch_noise_pred(transformer: TransformerView | nn.Module, states: Sequence[RolloutState]) -> torch.Tensor:
    """`denoise_step`: one batched forward over the running requests, noise_pred `(B, S, C)` float32, rows in
    `states` order. Requests may be at different steps; text is padded to the shared width.

    Raises:
        ValueError: the requests need different forwards (CFG scale, image size, text width).
        rollout_consistency.adapters.pitfalls.MixedDtypeBatchError: a request's latents are not float32.
    """
    if not states:
        raise ValueError("batch_noise_pred needs at least one running request.")
    batch = states[0].request.batch
    if any(_forward_settings(s.request.batch) != _forward_settings(batch) for s in states[1:]):
        raise ValueError(
            "Requests with different forward settings (guidance, image size, text width) landed in one batch; send "
            "them in separate generate calls (vLLM-omni does not key step batches on extra_args)."
        )
    return stepwise.denoise_step(
        _family(batch),
        transformer,
        [s.state for s in states],
        guidance_scale=batch.guidance_scale,
        options=batch.options,
        text_width=batch.text_width,
    )


def advance_request(rollout: RolloutState, noise_pred: torch.Tensor) -> None:
    """`step_scheduler`: one scheduler step of one request, in float32; records the step inside the window.

    Args:
        noise_pred (`torch.Tensor` `(1, S, C)`, float32): the request's row of [`batch_noise_pred`].
    """
    state, batch = rollout.state, rollout.request.batch
    if state.finished:
        raise ValueError(f"{state.request.request_id} has already run its {state.num_steps} steps.")
    if noise_pred.dtype != torch.float32 or tuple(noise_pred.shape) != tuple(state.latents.shape):
        raise TypeError(
            f"advance_request takes this request's float32 noise_pred {tuple(state.latents.shape)}, got "
            f"{noise_pred.dtype} {tuple(noise_pred.shape)}: cast the transformer output with .float() before the scheduler."
        )
    stepwise.advance_request(
        state,
        noise_pred,
        noise_level=batch.noise_level,
        sde_type=batch.sde_type,
        include_normalizer=batch.include_normalizer,
    )


def finish_request(rollout: RolloutState) -> Trajectory:
    """`post_decode`: the request's validated float32 [`Trajectory`] (B = 1), final latents included.

    The stored conditioning is padded as its forwards padded it (`stepwise.stored_conditioning`).
    """
    state, request = rollout.state, rollout.request
    batch = request.batch
    if not state.finished:
        raise ValueError(f"{state.request.request_id} stopped at step {state.step_index} of {state.num_steps}.")
    conditioning = stepwise.stored_conditioning(_family(batch), state.request.conditioning, batch.text_width)
    return stepwise.window_trajectory(
        state.record,
        seed=request.request.seed,
        prompt_group=request.request.prompt_group,
        conditioning=conditioning,
        model_family=batch.model_family,
        scheduler_setup=batch.scheduler,
        noise_level=batch.noise_level,
        sde_type=batch.sde_type,
        guidance_scale=batch.guidance_scale,
        global_step=request.request.global_step,
        family_options=batch.options,
        include_normalizer=batch.include_normalizer,
        final_latents=state.latents,
        provenance={"path": "vllm-omni", **rollout.provenance},
    )


# ---------------------------------------------------------------------------------- trajectory envelope
def trajectory_to_payload(trajectory: Trajectory, request: RequestSettings) -> dict[str, Any]:
    """The envelope's `payload["trajectory"]`: CPU tensors plus plain fields, exact (no dtype change).

    `latents` (B, W+1, S, C), `timesteps` (B, W) and `log_probs` (B, W) are the keys vLLM-omni copies onto
    `OmniRequestOutput.trajectory_latents / trajectory_timesteps / trajectory_log_probs`; the whole mapping
    lands in `OmniRequestOutput.multimodal_output["trajectory"]`.
    """
    tensors, fields_ = trajectory.to_parts()
    # The three standard keys at the top level (vLLM-omni copies them onto the request output); the rest
    # of the tensors (final latents, conditioning) travel under "tensors".
    payload: dict[str, Any] = {
        "format": ENVELOPE_FORMAT,
        "version": PAYLOAD_VERSION,
        **{name: tensors.pop(name) for name in ("latents", "log_probs", "timesteps")},
        "tensors": tensors,
        "fields": fields_,
        "request": request.to_payload(),
    }
    return payload


def trajectory_from_payload(payload: Mapping[str, Any]) -> Trajectory:
    """Inverse of [`trajectory_to_payload`]: the validated [`Trajectory`].

    Raises:
        TrajectoryFormatError: not our payload, another version, a missing field, or a tensor that is not float32
            (nothing is cast: a low-precision tensor means the engine kept a rounded copy).
    """
    if not isinstance(payload, Mapping) or payload.get("format") != ENVELOPE_FORMAT:
        found = payload.get("format") if isinstance(payload, Mapping) else type(payload).__name__
        raise TrajectoryFormatError(
            f"The output's trajectory is not a rollout-consistency payload (format {found!r}): was the engine started "
            f"with custom_pipeline_args={{'pipeline_class': {PIPELINE_CLASS!r}}}?"
        )
    if payload.get("version") != PAYLOAD_VERSION:
        raise TrajectoryFormatError(
            f"Trajectory payload version {payload.get('version')!r}; this client reads {PAYLOAD_VERSION}. Install the same "
            f"rollout-consistency version on the client and the engine."
        )
    try:
        tensors = {name: payload[name] for name in ("latents", "log_probs", "timesteps")}
        tensors.update(payload["tensors"])
        fields_ = payload["fields"]
    except (KeyError, TypeError) as error:
        raise TrajectoryFormatError(f"The trajectory payload is incomplete or invalid: {error!r}") from error
    return Trajectory.from_parts(tensors, fields_, source="vLLM-omni trajectory payload")


def output_envelope(image: Any, trajectory_payload: Mapping[str, Any]) -> dict[str, Any]:
    """What `post_decode` returns as `DiffusionOutput.output`: vLLM-omni's output envelope.

    The Qwen-Image post-process turns `payload["image"]` into PIL images and passes `payload["trajectory"]`
    through; never return the trajectory alone (an output without an image is dropped).
    """
    return {
        "payload": {"image": image, "trajectory": dict(trajectory_payload)},
        "metadata": {"trajectory": {"type": "denoising", "format": ENVELOPE_FORMAT, "version": PAYLOAD_VERSION}},
    }


def order_by_sample_index(items: Sequence[tuple[str, Mapping[str, Any]]], count: int) -> list[Mapping[str, Any]]:
    """Put `(request_id, trajectory payload)` pairs, in completion order, back in request order.

    The order comes from each payload's echoed `request.sample_index`; `Omni.generate`'s request ids
    (`"{i}_{uuid}"`) must agree with it.

    Raises:
        ValueError: a missing, duplicated or out-of-range sample, or an id that contradicts its payload.
    """
    ordered: list[Mapping[str, Any] | None] = [None] * count
    for request_id, payload in items:
        try:
            index = payload["request"]["sample_index"]
        except (KeyError, TypeError) as error:
            raise ValueError(
                f"Output {request_id!r} has no echoed sample_index: not a rollout-consistency payload."
            ) from error
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
            raise ValueError(f"Output {request_id!r} echoes sample_index {index!r}, outside 0..{count - 1}.")
        prefix = str(request_id).split("_", 1)[0]
        if prefix.isdigit() and int(prefix) != index:
            raise ValueError(f"Output {request_id!r} (request {prefix}) carries the trajectory of sample {index}.")
        if ordered[index] is not None:
            raise ValueError(f"Two outputs carry sample {index}.")
        ordered[index] = payload
    missing = [i for i, payload in enumerate(ordered) if payload is None]
    if missing:
        raise ValueError(f"No trajectory came back for sample(s) {missing} of {count}.")
    return ordered  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------- the engine
def engine_kwargs(
    *,
    dtype: str = "bfloat16",
    step_execution: bool = False,
    max_num_seqs: int = 1,
    enforce_eager: bool = True,
    attention_backend: str | None = None,
    request_batch_max_wait_ms: float | None = None,
    engine_options: Mapping[str, Any] | None = None,
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
        engine_options: any other `OmniDiffusionConfig` field; may not replace the pipeline class.
    """
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
        "custom_pipeline_args": {"pipeline_class": PIPELINE_CLASS},
    }
    if attention_backend is not None:
        kwargs["diffusion_attention_config"] = {"default": attention_backend}
    for name, value in dict(engine_options or {}).items():
        if name == "custom_pipeline_args":
            value = dict(value)
            if value.get("pipeline_class", PIPELINE_CLASS) != PIPELINE_CLASS:
                raise ValueError(
                    f"engine_options would replace the pipeline class {PIPELINE_CLASS!r} with "
                    f"{value['pipeline_class']!r}; trajectories come only from that class."
                )
            value["pipeline_class"] = PIPELINE_CLASS
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
        engine: an engine already started on `model_path` with [`engine_kwargs`] (anything with vLLM-omni's
            `generate(prompts, sampling_params, use_tqdm=...)` and `close()`), used instead of starting one.
        Others: see [`engine_kwargs`].

    A failed request raises [`VllmOmniRequestError`] naming it. vLLM-omni shuts the engine down when a request
    fails, so from then on every call raises [`VllmOmniEngineClosedError`]: start a new `VllmOmniRollout`.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "bfloat16",
        step_execution: bool = False,
        max_num_seqs: int = 1,
        enforce_eager: bool = True,
        attention_backend: str | None = None,
        request_batch_max_wait_ms: float | None = None,
        launcher_seed: int | None = None,
        window_schedule: SDEWindowSchedule | None = None,
        engine_options: Mapping[str, Any] | None = None,
        engine: Any = None,
    ):
        kwargs = engine_kwargs(
            dtype=dtype,
            step_execution=step_execution,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            attention_backend=attention_backend,
            request_batch_max_wait_ms=request_batch_max_wait_ms,
            engine_options=engine_options,
        )
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
        self.step_execution = bool(step_execution)
        self.max_num_seqs = max_num_seqs
        self.launcher_seed = launcher_seed
        self.window_schedule = window_schedule
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
        seeds: Sequence[int],
        window: SDEWindow | Sequence[SDEWindow],
        noise_level: float,
        sde_type: str = "sde",
        guidance_scale: float = 1.0,
        options: Mapping[str, Any],
        prompt_groups: Sequence[int] | None = None,
        global_step: int = 0,
        include_normalizer: bool = True,
        injection: Any = None,
        max_num_seqs: int | None = None,
        step_execution: bool | None = None,
        text_width: int | None = None,
        prompts: Sequence[str] | None = None,
        negative_prompts: Sequence[str] | None = None,
    ) -> Trajectory:
        """Sample a batch on the engine: the same arguments as `rollout_consistency.adapters.rollout`, the same float32 [`Trajectory`].

        Rows are in the order of `seeds` (completion order is mapped back). `transformer` is accepted for
        signature compatibility and unused: the engine holds its own copy of the weights from `model_path`.
        `max_num_seqs` / `step_execution`, when given, must match the engine's (they are fixed at start).

        Raises:
            ValueError: bad settings (before anything is sent), an injection (stock-behaviour reproductions
                exist for the PyTorch adapters only), or engine settings that differ from the call's.
            VllmOmniRequestError: a request failed in the engine (the engine is closed after it).
            VllmOmniEngineClosedError: the engine was closed before this call.
            TrajectoryFormatError: a request returned no valid trajectory.
        """
        if self._closed_by is not None:
            raise VllmOmniEngineClosedError(
                f"The vLLM-omni engine on {self.model_path} is closed: {self._closed_by}. Start a new VllmOmniRollout."
            )
        if injection:
            raise ValueError(
                "--inject reproduces stock behaviours inside the PyTorch adapters; it has no meaning for the vLLM-omni "
                "engine. Run the injection with rollout_backend 'torch'."
            )
        if family is not None and family.name not in SUPPORTED_FAMILIES:
            raise ValueError(
                f"model family {family.name!r} has no vLLM-omni pipeline (have: {', '.join(SUPPORTED_FAMILIES)})."
            )
        for name, asked, running in (
            ("max_num_seqs", max_num_seqs, self.max_num_seqs),
            ("step_execution", step_execution, self.step_execution),
        ):
            if asked is not None and asked != running:
                raise ValueError(f"The engine was started with {name}={running!r}; this call asks for {asked!r}.")
        request_prompts, extra_args = build_requests(
            conditioning,
            scheduler_setup=scheduler_setup,
            seeds=seeds,
            window=window,
            noise_level=noise_level,
            sde_type=sde_type,
            guidance_scale=guidance_scale,
            options=options,
            prompt_groups=prompt_groups,
            global_step=global_step,
            include_normalizer=include_normalizer,
            text_width=text_width,
            launcher_seed=self.launcher_seed,
            window_schedule=self.window_schedule,
            prompts=prompts,
            negative_prompts=negative_prompts,
        )
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        sampling = OmniDiffusionSamplingParams(
            **sampling_params_kwargs(
                scheduler_setup=scheduler_setup,
                options=options,
                guidance_scale=guidance_scale,
                extra_args=extra_args,
                launcher_seed=self.launcher_seed,
            )
        )
        try:
            outputs = self._omni.generate(request_prompts, sampling, use_tqdm=False)
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
        "(the checker builds it from its config in rollout_consistency.gate.backends)."
    )
