# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Whether the vLLM-omni backend can run here, and the errors its engine client raises.

Finding vLLM-omni imports nothing ([`vllm_omni_available`], [`require_vllm_omni`] use
`importlib.util.find_spec`); the client calls [`require_vllm_omni`] before it starts an engine, so a machine
without the `vllm` extra gets [`VllmOmniUnavailableError`] naming the extra to install instead of an
`ImportError` from deep inside vLLM.
"""

from __future__ import annotations

import importlib.util

import torch

__all__ = [
    "INSTALL_HINT",
    "VLLM_OMNI_VERSION",
    "VllmOmniEngineClosedError",
    "VllmOmniEngineError",
    "VllmOmniRequestError",
    "VllmOmniUnavailableError",
    "require_vllm_omni",
    "vllm_omni_available",
]

#: The vLLM-omni release the backend was written and audited against (with vLLM of the same version).
VLLM_OMNI_VERSION = "0.30.0"
INSTALL_HINT = (
    "pip install 'rollout-consistency[vllm]' (vllm-omni==0.30.0 with vllm==0.30.0) on a machine with an NVIDIA "
    "GPU and CUDA; see docs/vllm-omni.md"
)


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
