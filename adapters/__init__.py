# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Rollout and training adapters on diffusers, with float32 trajectories.

The main entry points (stable; see docs/adapters.md and docs/design.md):

    rollout(family, transformer, conditioning, *, scheduler_setup, requests, sampling, ...) -> Trajectory
        the request-level rollout (`rollout_consistency.adapters.rollout`)
    BatchRequests, SamplingSettings
        the frozen settings a rollout takes: who the samples are, how each step is sampled
        (`rollout_consistency.adapters.settings`)
    recompute_log_probs(transformer, trajectory, *, family=None, steps=None, autocast_dtype=None) -> (B, W) f32
    recompute_step_log_prob(transformer, trajectory, k, ...) -> (B,) f32, differentiable
        the trainer's side (`rollout_consistency.adapters.trainer`)
    Trajectory, TrajectoryFormatError, stack_trajectories
        the float32 trajectory and its file format (`rollout_consistency.adapters.trajectory`)
    ModelFamily, register_family, get_family, family_names, PipelineSettings
        one frozen description per model family and the registry (`rollout_consistency.adapters.families`)
    make_generators(seeds)
        one seeded CPU generator per sample (the noise contract)
    INJECTION_NAMES, MixedDtypeBatchError, apply_injection
        stock-behaviour reproductions (`rollout_consistency.adapters.pitfalls`; tests and `--inject` only)

Modules, each with its own `__all__`: `qwen_image` (imported here), and on first access the other built-in
families' modules (`sd3`, `flux`, `wan`: `rollout_consistency.base.builtin_families` names them; each one's
`rollout` and `recompute_log_probs` come from `rollout_consistency.adapters.entry_points`), `stepwise` (step-wise
continuous batching), `packing`, `rope`, `tiny` (the tiny offline models) and
`vllm_omni` (the vLLM-omni backend, a subpackage). Importing this package never imports vllm.
"""

from __future__ import annotations

import importlib

from rollout_consistency.base.builtin_families import BUILTIN_FAMILIES

from . import qwen_image
from .families import ModelFamily, family_names, get_family, register_family
from .pitfalls import INJECTION_NAMES, MixedDtypeBatchError, apply_injection
from .rollout import make_generators, rollout
from .settings import BatchRequests, PipelineSettings, SamplingSettings
from .trainer import recompute_log_probs, recompute_step_log_prob
from .trajectory import Trajectory, TrajectoryFormatError, stack_trajectories

__all__ = [
    "INJECTION_NAMES",
    "BatchRequests",
    "MixedDtypeBatchError",
    "ModelFamily",
    "PipelineSettings",
    "SamplingSettings",
    "Trajectory",
    "TrajectoryFormatError",
    "apply_injection",
    "family_names",
    "get_family",
    "make_generators",
    "qwen_image",
    "recompute_log_probs",
    "recompute_step_log_prob",
    "register_family",
    "rollout",
    "stack_trajectories",
]

# The built-in families' modules (their records, `rollout_consistency.base.builtin_families`) and the other heavy ones.
_FAMILY_MODULES = tuple(
    f.module.rpartition(".")[2] for f in BUILTIN_FAMILIES.values() if f.module.startswith(f"{__name__}.")
)
_LAZY_SUBMODULES = (*_FAMILY_MODULES, "stepwise", "packing", "rope", "tiny", "vllm_omni")


def __getattr__(name: str):
    # Submodules with heavy or optional imports load on first access.
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
