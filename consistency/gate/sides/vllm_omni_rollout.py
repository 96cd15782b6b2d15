# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""The ``vllm-omni`` rollout backend: one vLLM-omni engine per worker, one ``generate`` call per batch.

[`start`] (the registered factory, `rollout_consistency.gate.backend_registry`) starts the engine from the
settings ([`vllm_omni_engine_arguments`]); the engine holds its own copy of ``model_path``'s weights, and
each batch's conditioning is the one the trainer re-scores. The engine-side code is
`rollout_consistency.adapters.vllm_omni`; this module only translates the settings.
"""

from __future__ import annotations

from typing import Any

from .plan import window_schedule
from .settings import SidesSettings
from .shared import Backend, BackendError

__all__ = ["VllmOmniSide", "start", "vllm_omni_engine_arguments"]


class VllmOmniSide:
    """The rollout side of a worker whose samples come from a started `VllmOmniRollout` (`engine`)."""

    in_process = False

    def __init__(self, engine: Any):
        self.engine = engine

    def rollout(self, backend: Backend, conditioning: Any, requests: Any, sampling: Any) -> Any:
        """One planned batch on the engine: a float32 `Trajectory` (the engine encodes nothing itself here).

        Raises:
            ValueError: the engine was started with another `max_num_seqs` or `step_execution` than the settings
                ask for (both are fixed when an engine starts).
        """
        execution = backend.settings.execution
        for name in ("max_num_seqs", "step_execution"):
            running, asked = getattr(self.engine, name), getattr(execution, name)
            if running != asked:
                raise ValueError(f"The engine was started with {name}={running!r}; this call asks for {asked!r}.")
        return self.engine.rollout(
            backend.family,
            None,
            conditioning,
            scheduler_setup=backend.scheduler_setup,
            requests=requests,
            sampling=sampling,
            options=backend.options,
        )


def start(settings: SidesSettings) -> VllmOmniSide:
    """The started vLLM-omni engine for `settings`.

    Raises:
        BackendError: vLLM-omni, vLLM or CUDA is missing (naming the ``vllm`` extra), or the engine cannot start
            from the settings (e.g. no ``model_path``).
    """
    from rollout_consistency.adapters import vllm_omni  # imports no vLLM: only the engine does, when it starts

    try:
        vllm_omni.require_vllm_omni()
    except ImportError as error:
        raise BackendError(str(error)) from error
    arguments = vllm_omni_engine_arguments(settings)
    try:
        return VllmOmniSide(vllm_omni.VllmOmniRollout(**arguments))
    except (ValueError, FileNotFoundError) as error:
        raise BackendError(f"the vLLM-omni engine cannot start: {error}") from error


def vllm_omni_engine_arguments(settings: SidesSettings) -> dict[str, Any]:
    """The `VllmOmniRollout` keyword arguments `settings` ask for (validated here; starts nothing, imports no vLLM).

    Raises:
        BackendError: no ``model_path`` (the engine serves a whole diffusers directory, not the tiny transformer).
    """
    model, execution = settings.model, settings.execution
    if model.model_path is None:
        raise BackendError(
            "rollout_backend 'vllm-omni' loads a model directory: set model_path to a local diffusers Qwen-Image "
            "directory (the built-in tiny model is a transformer only, with no text encoder or VAE to serve)."
        )
    return {
        "model_path": model.model_path,
        "dtype": model.rollout_dtype,
        "step_execution": execution.step_execution,
        "max_num_seqs": execution.max_num_seqs,
        "launcher_seed": settings.sampling.seed,
        "window_schedule": window_schedule(settings.sampling),
    }
