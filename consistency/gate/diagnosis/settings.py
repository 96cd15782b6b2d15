# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""[`DiagnosisSettings`]: what the doctor's replay knows of a step-1 check's settings, as one frozen object.

The replay (`rollout_consistency.gate.diagnosis.replay`) runs both sides once more on one batch: it needs to know
whether their code is in this process (a trajectory file or an engine in its own process is not), how to build
them as the check did, and the step settings the comparison fits against. The check builds this once, from its
`CheckConfig` (`DiagnosisSettings.from_config`); the doctor reads no other settings.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_consistency.gate.config import CheckConfig

if TYPE_CHECKING:  # the sides load when a replay builds them, not when the command line starts
    from rollout_consistency.gate.sides.shared import Backend

__all__ = ["DiagnosisSettings"]


@dataclass(frozen=True)
class DiagnosisSettings:
    """The settings the doctor's replay reads.

    Attributes:
        rollout_from_file: the rollout is a saved trajectory file (its code is not in this process).
        rollout_backend: the rollout's registered backend or plug-in spec (``"vllm-omni"`` runs in its own
            process). rollout_attention, trainer_attention: each side's attention kernel.
        window_size: SDE steps per sample. noise_level, sde_type: the SDE step the sides were asked for.
        start_sides: builds both sides afresh, as a worker of the check did (`rollout_consistency.gate.sides.backends.build_backend`
            with the check's settings; plug-in factories get the `CheckConfig`, as in the check).
    """

    rollout_from_file: bool
    rollout_backend: str
    rollout_attention: str
    trainer_attention: str
    window_size: int
    noise_level: float
    sde_type: str
    start_sides: Callable[[], Backend]

    @classmethod
    def from_config(cls, config: CheckConfig) -> DiagnosisSettings:
        """The doctor's settings of the check `config`."""
        from rollout_consistency.gate.sides.backends import build_backend

        return cls(
            rollout_from_file=config.trajectory is not None,
            rollout_backend=config.rollout_backend,
            rollout_attention=config.rollout_attention,
            trainer_attention=config.trainer_attention,
            window_size=config.resolved_window_size,
            noise_level=float(config.noise_level),
            sde_type=config.sde_type,
            start_sides=functools.partial(build_backend, config.sides),
        )
