# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Test helper: the tests vary one rollout setting at a time as a flat keyword; this packs them into the
frozen [`BatchRequests`] / [`SamplingSettings`] that the rollouts take."""

from __future__ import annotations

from typing import Any

from rollout_consistency.adapters import BatchRequests, SamplingSettings

_SAMPLING = ("noise_level", "sde_type", "guidance_scale", "include_normalizer")
_REQUESTS = {"seeds": "seeds", "window": "windows", "prompt_groups": "prompt_groups", "global_step": "global_step"}


def sampling_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with its sampling keywords replaced by `sampling=SamplingSettings(...)`."""
    rest = dict(kwargs)
    picked = {name: rest.pop(name) for name in _SAMPLING if name in rest}
    return {**rest, "sampling": SamplingSettings(**picked)}


def rollout_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with its sampling and per-sample keywords replaced by `sampling=` and `requests=BatchRequests(...)`."""
    rest = sampling_args(kwargs)
    picked = {field: rest.pop(name) for name, field in _REQUESTS.items() if name in rest}
    return {**rest, "requests": BatchRequests(**picked)}
