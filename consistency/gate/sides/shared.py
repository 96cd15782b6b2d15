# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What the built-in backends, the plug-in sides and the trainer side share: a worker's state ([`Backend`]),
one batch's result ([`BatchResult`]), [`BackendError`], the attention-kernel switch and the prompt encoding.

Plain data and two small functions, below every module that runs a side, so that none of them needs another
to name these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_consistency.gate.config import ConfigError
from rollout_consistency.gate.judging.tolerances import closest_name

from .settings import SidesSettings


class BackendError(RuntimeError):
    """A backend cannot be built as configured (missing package, unknown kernel, model not found)."""


class SharedTableError(BackendError):
    """The trainer's output shares memory with what it was given (the rollout's stored log-probs): it recomputed
    nothing. The batch's scorer turns it into a ``distinct`` FAIL that keeps `table` (the output's values) to
    show; anywhere else it is a usage error."""

    def __init__(self, message: str, table: np.ndarray) -> None:
        super().__init__(message)
        self.table = table


@dataclass(frozen=True)
class BatchResult:
    """What one rollout batch gives back (numpy, small, picklable).

    Attributes:
        batch: the batch index. sample_indices: global sample indices, in order.
        rollout_log_probs, trainer_log_probs (`np.ndarray` `(n, W)` float32): both sides' log-probs.
        floor_log_probs (`np.ndarray` `(n, W)` float32 or None): the trainer with the other kernel.
        timesteps (`np.ndarray` `(n, W)` float32): exact timestep of each stored step.
        window_starts, prompt_groups, seeds: per sample, as the rollout stored them.
        forwards: transformer forwards run, by stage (``rollout``, ``trainer``, ``floor``).
        seconds: wall time by stage.
        precision: the precision-audit diff (rollout vs trainer) of the process that ran the batch, or None.
        problems: why the batch has no log-probs (the rollout engine failed); empty on success.
        findings: ``(guard, reason)`` pairs this batch fails although both tables came back (they are still
            compared and shown): ``distinct`` (the trainer's output is the rollout's memory, or it changed what
            the rollout stored), ``windows`` (a side's tables are not the plan's window).
    """

    batch: int
    sample_indices: tuple[int, ...]
    rollout_log_probs: np.ndarray
    trainer_log_probs: np.ndarray
    floor_log_probs: np.ndarray | None
    timesteps: np.ndarray
    window_starts: tuple[int, ...]
    prompt_groups: tuple[int, ...]
    seeds: tuple[int, ...]
    forwards: Mapping[str, int] = field(default_factory=dict)
    seconds: Mapping[str, float] = field(default_factory=dict)
    precision: Mapping[str, Any] | None = None
    problems: tuple[str, ...] = ()
    #: ``calibrated``: the trainer's log-probs with each other source of difference changed (batch
    #: composition, implementation; `rollout_consistency.gate.judging.tolerance_model`), by source name.
    floor_tables: Mapping[str, np.ndarray] = field(default_factory=dict)
    weights: Mapping[str, Any] | None = None  # rollout_consistency.gate.sides.plugins.fingerprints of the two sides
    #: Models with experts by timestep (Wan 2.2): ``{"rollout": rows, "trainer": rows}``, one tuple of expert names
    #: per sample (window order) each side scored the stored steps with; a side's None: it recorded none.
    experts: Mapping[str, Any] | None = None
    findings: tuple[tuple[str, str], ...] = ()


# ----------------------------------------------------------------------------------------------------
@dataclass
class Backend:
    """A worker's state: both sides' models and what they need. Built once per worker by `build_backend`, from
    the sides' `settings` (`rollout_consistency.gate.sides.settings`)."""

    settings: SidesSettings
    family: Any
    rollout_model: Any
    trainer_model: Any
    encoder: Any
    scheduler_setup: Any
    options: dict[str, Any]
    guidance: float
    cfg_passes: int
    injection: str | None
    floor_kernel: str | None
    #: The registered rollout backend as its factory built it (`rollout_consistency.gate.backend_registry`):
    #: ``in_process`` and ``rollout(backend, conditioning, requests, sampling)``; None for a plug-in rollout.
    rollout_engine: Any = None
    precision: Mapping[str, Any] | None = None
    plugins: Any = None  # rollout_consistency.gate.sides.plugins.PluginSides when a side is a user's plug-in
    weights: Mapping[str, Any] | None = None
    #: The trainer's recompute, ``(backend, trajectory, kernel) -> (B, W)`` float32: the registered trainer
    #: backend's (``torch``: `rollout_consistency.gate.sides.trainer.torch_log_probs`) or a plug-in's
    #: (`rollout_consistency.gate.sides.plugins.plugin_recompute`).
    trainer_recompute: Callable[[Backend, Any, str], np.ndarray] | None = None
    #: A trainer plug-in's optional expert record, ``(backend, batch, (n, W)) -> names | None``
    #: (`rollout_consistency.gate.sides.plugins.plugin_trainer_experts`); None: the built-in trainer's.
    trainer_experts: Callable[[Backend, Any, tuple[int, ...]], Any] | None = None
    #: The family's classifier-free guidance scale for these settings (1: off; 2 passes per step above 1).
    cfg_scale: float = 1.0


def encode_prompts(backend: Backend, prompts: Sequence[str]) -> dict[str, Any]:
    """The batch's conditioning: the prompts (and, under CFG, the family's negative prompt) through the encoder."""
    negatives = [backend.family.negative_prompt] * len(prompts) if backend.cfg_passes > 1 else None
    return backend.encoder(list(prompts), negatives)


@contextlib.contextmanager
def attention(name: str) -> Iterator[None]:
    """Run diffusers attention with backend `name` (``native`` = PyTorch SDPA, ``_native_math`` = its math
    kernel, ...) inside the block. An unknown name or a backend that cannot run here is a `ConfigError`."""
    from diffusers.models.attention_dispatch import AttentionBackendName, attention_backend

    valid = [b.value for b in AttentionBackendName]
    if name not in valid:
        raise ConfigError(
            f"attention backend {name!r} is not one of diffusers' backends ({', '.join(valid)}).{closest_name(name, valid)}"
        )
    manager = attention_backend(name)
    try:
        manager.__enter__()
    except Exception as error:  # requirements not met (flash kernels on a CPU, a missing package)
        raise ConfigError(f"attention backend {name!r} cannot run here: {error}") from error
    try:
        yield
    finally:
        manager.__exit__(None, None, None)  # restores the previous backend
