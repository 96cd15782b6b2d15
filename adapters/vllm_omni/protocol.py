# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The wire protocol between the engine client and the pipeline in vLLM-omni's worker: request settings.

The client turns one batch into prompt dicts plus one shared `extra_args` ([`build_requests`]); the worker
reads each request back ([`decode_request`]) into a [`RolloutRequest`]. Everything on the wire is plain,
msgpack-able data under the key [`PAYLOAD_KEY`], versioned by [`PAYLOAD_VERSION`]:

    per request: prompt["additional_information"][PAYLOAD_KEY] = {"version", "request": RequestSettings}
    batch-wide:  sampling_params.extra_args[PAYLOAD_KEY]         = {"version", "batch": BatchSettings}

Decoding fails closed: a missing, malformed, unknown-keyed or other-version block raises ValueError naming
the fix (only vLLM-omni's warm-up request may carry none), and the SDE window is resolved, and cross-checked
against the launcher's window schedule, on both sides ([`resolve_window`]).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rollout_consistency.adapters import stepwise
from rollout_consistency.adapters.qwen_image import latent_grid
from rollout_consistency.adapters.rollout import resolve_windows
from rollout_consistency.adapters.settings import BatchRequests, SamplingSettings
from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES
from rollout_consistency.schedulers import SchedulerSetup, SDEWindow, SDEWindowSchedule

__all__ = [
    "PAYLOAD_KEY",
    "PAYLOAD_VERSION",
    "PIPELINE_CLASS",
    "PIPELINE_CLASSES",
    "SUPPORTED_FAMILIES",
    "BatchSettings",
    "PromptTexts",
    "RequestSettings",
    "RolloutRequest",
    "build_requests",
    "decode_request",
    "resolve_window",
]

#: Key of our block in `prompt["additional_information"]`, `sampling_params.extra_args` and `state.extra`.
PAYLOAD_KEY = "rollout_consistency"
PAYLOAD_VERSION = 1
#: The pipeline class vLLM-omni loads for each family (`custom_pipeline_args={"pipeline_class": ...}`): a qualified
#: name, re-imported inside vLLM-omni's worker (the built-in families' records, `rollout_consistency.base.builtin_families`).
PIPELINE_CLASSES = {f.name: f.vllm_omni_pipeline for f in BUILTIN_FAMILIES.values() if f.vllm_omni_pipeline}
#: The default `custom_pipeline_args["pipeline_class"]` (Qwen-Image's).
PIPELINE_CLASS = PIPELINE_CLASSES["qwen-image"]
#: The model families with a vLLM-omni pipeline.
SUPPORTED_FAMILIES = tuple(PIPELINE_CLASSES)
_TEXT_FIELDS = ("prompt_embeds", "prompt_embeds_mask", "negative_prompt_embeds", "negative_prompt_embeds_mask")
_BLOCK_KEYS = {"version", "batch", "request"}


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


def _check_options(model_family: str, options: Mapping[str, Any]) -> None:
    """ValueError unless the family's size options are there (Qwen-Image: packable height/width; Wan: height,
    width and num_frames, checked against the transformer when the request starts)."""
    if model_family == "qwen-image":
        latent_grid(options)
        return
    for key in ("height", "width", "num_frames"):
        _int(key, options.get(key), 1)


@dataclass(frozen=True)
class BatchSettings:
    """Settings shared by every request of one `generate` call (`sampling_params.extra_args[PAYLOAD_KEY]["batch"]`).

    A wire format: each setting is its own plain field (what `to_payload` writes and `from_payload` reads
    back), not the adapters' settings objects; the sampling fields are checked by building the
    `SamplingSettings` they describe ([`sampling`]).

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
        model_family: `"qwen-image"` or `"wan"` (the families with a vLLM-omni pipeline, `PIPELINE_CLASSES`).
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
        object.__setattr__(self, "noise_level", _float("noise_level", self.noise_level))
        object.__setattr__(self, "guidance_scale", _float("guidance_scale", self.guidance_scale))
        self.sampling  # noqa: B018 - the sampling rules, checked where every rollout's are (SamplingSettings)
        options = dict(_mapping("options", self.options))
        _check_options(self.model_family, options)
        object.__setattr__(self, "options", options)
        _int("text_width", self.text_width, 1, optional=True)
        if self.window_schedule is not None and self.window_schedule.num_steps != self.scheduler.num_inference_steps:
            raise ValueError(
                f"window_schedule is for {self.window_schedule.num_steps} steps but the schedule has "
                f"{self.scheduler.num_inference_steps}."
            )

    @property
    def sampling(self) -> SamplingSettings:
        """The batch's sampling settings (noise level, SDE type, guidance, normaliser) as the adapters take them."""
        return SamplingSettings.of(self)

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

    A wire format, like [`BatchSettings`]: plain fields, each checked as it is decoded.

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


@dataclass(frozen=True)
class PromptTexts:
    """Prompt texts for the engine's own text encoder, in place of embeddings (`build_requests`' `conditioning`).

    Args:
        prompts: one text per sample. negative_prompts: one negative text per sample, for CFG (`" "` is fine).
    """

    prompts: Sequence[str]
    negative_prompts: Sequence[str] | None = None

    def __post_init__(self) -> None:
        for name in ("prompts", "negative_prompts"):
            texts = getattr(self, name)
            if texts is not None and (isinstance(texts, str) or not all(isinstance(t, str) for t in texts)):
                raise TypeError(f"PromptTexts.{name} must be a sequence of strings (one per sample), got {texts!r}.")
            object.__setattr__(self, name, None if texts is None else tuple(texts))


def build_requests(
    conditioning: Mapping[str, torch.Tensor] | PromptTexts,
    *,
    scheduler_setup: SchedulerSetup,
    requests: BatchRequests,
    sampling: SamplingSettings,
    options: Mapping[str, Any],
    text_width: int | None = None,
    window_schedule: SDEWindowSchedule | None = None,
    model_family: str = "qwen-image",
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The prompt dicts and the shared `extra_args` for one `Omni.generate` call.

    Args:
        conditioning: batch-first Qwen-Image conditioning (`prompt_embeds` (B, L, D) float32, masks int64, …);
            each request gets its row, so the engine runs the trainer's exact embeddings. Or [`PromptTexts`]:
            the engine's text encoder embeds them (the trajectory then stores the engine's embeddings).
        requests ([`BatchRequests`]): the samples, as for `rollout_consistency.adapters.rollout`;
            `requests.windows=None` sends no explicit window: the engine derives each from
            (`requests.launcher_seed`, global_step, prompt group) with `window_schedule` (both then required).
        sampling ([`SamplingSettings`]): noise level, SDE type, guidance scale and normaliser of every step.
        text_width: the shared text width of every forward; default: the conditioning's width (all rows
            padded alike, as the checker's step-wise torch path does), or `None` with `PromptTexts`.
        window_schedule: with `requests.launcher_seed`, lets the engine re-derive and check each window.
        model_family: the family the engine's pipeline serves (`PIPELINE_CLASSES`).
        Others: see [`BatchSettings`].

    Returns:
        `(prompts, extra_args)`: pass `extra_args` as `OmniDiffusionSamplingParams(extra_args=...)`.
    """
    seeds, groups, global_step, window = requests.seeds, requests.groups, requests.global_step, requests.windows
    launcher_seed = requests.launcher_seed
    count = len(seeds)
    texts = conditioning if isinstance(conditioning, PromptTexts) else None
    conditioning = None if texts is not None else conditioning
    if window is None:
        if window_schedule is None or launcher_seed is None:
            raise ValueError(
                "windows=None needs window_schedule and launcher_seed: the engine derives each window from them."
            )
        windows: Sequence[SDEWindow | None] = [None] * count
    else:
        windows = resolve_windows(requests, scheduler_setup.num_inference_steps)
    if conditioning is None and texts is None:
        raise ValueError("Pass `conditioning` (embeddings) or PromptTexts (texts for the engine's text encoder).")
    for name in ("prompts", "negative_prompts"):
        given = None if texts is None else getattr(texts, name)
        if given is not None and len(given) != count:
            raise ValueError(f"{len(given)} {name} for {count} seeds: pass one per sample.")
    rows = None
    if conditioning is not None:
        for name, tensor in conditioning.items():
            if tensor.shape[0] != count:
                raise ValueError(f"conditioning[{name!r}] has {tensor.shape[0]} rows for {count} seeds.")
        rows = [{k: v[i : i + 1] for k, v in conditioning.items()} for i in range(count)]
        if text_width is None:
            text_width = stepwise.shared_text_width(rows)
    batch = BatchSettings(  # the wire's own fields (see BatchSettings), from the adapters' settings objects
        scheduler=scheduler_setup,
        noise_level=sampling.noise_level,
        sde_type=sampling.sde_type,
        guidance_scale=sampling.guidance_scale,
        options=options,
        include_normalizer=sampling.include_normalizer,
        text_width=text_width,
        window_schedule=window_schedule,
        model_family=model_family,
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
            "prompt": "" if texts is None else texts.prompts[index],
            "additional_information": {PAYLOAD_KEY: {"version": PAYLOAD_VERSION, "request": request.to_payload()}},
        }
        if texts is not None and texts.negative_prompts is not None:
            prompt["negative_prompt"] = texts.negative_prompts[index]
        if rows is not None:
            prompt.update(_conditioning_row(rows[index]))
        request_prompts.append(prompt)
    extra_args = {PAYLOAD_KEY: {"version": PAYLOAD_VERSION, "batch": batch.to_payload()}}
    return request_prompts, extra_args
