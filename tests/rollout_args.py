# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Test helper: the tests vary one rollout setting at a time as a flat keyword; this packs them into the
frozen [`BatchRequests`] / [`SamplingSettings`] (and the step-wise `EngineSettings`) that the rollouts take."""

from __future__ import annotations

from typing import Any

from rollout_consistency.adapters import BatchRequests, SamplingSettings

_SAMPLING = ("noise_level", "sde_type", "guidance_scale", "include_normalizer")
_REQUESTS = {
    "seeds": "seeds",
    "window": "windows",
    "prompt_groups": "prompt_groups",
    "global_step": "global_step",
    "denoise_to_end": "denoise_to_end",
    "launcher_seed": "launcher_seed",
}


def sampling_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with its sampling keywords replaced by `sampling=SamplingSettings(...)`."""
    rest = dict(kwargs)
    picked = {name: rest.pop(name) for name in _SAMPLING if name in rest}
    return {**rest, "sampling": SamplingSettings(**picked)}


def stepwise_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`sampling_args`, with `max_num_seqs` / `text_width` packed into `engine=EngineSettings(...)` (`run_stepwise`)."""
    from rollout_consistency.adapters.stepwise import EngineSettings

    rest = sampling_args(kwargs)
    picked = {name: rest.pop(name) for name in ("max_num_seqs", "text_width") if name in rest}
    return {**rest, "engine": EngineSettings(**picked)} if picked else rest


def rollout_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with its sampling and per-sample keywords replaced by `sampling=` and `requests=BatchRequests(...)`."""
    rest = sampling_args(kwargs)
    picked = {field: rest.pop(name) for name, field in _REQUESTS.items() if name in rest}
    return {**rest, "requests": BatchRequests(**picked)}
