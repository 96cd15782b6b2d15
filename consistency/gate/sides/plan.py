# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""What a step-1 check samples: which prompt, group, seed and SDE window each rollout gets, in which batch.

Everything here is a pure function of the sides' settings (`SidesSettings`: what is sampled, the batch size): sample ``i`` renders prompt ``i // n`` (``n`` =
``num_images_per_prompt``) in prompt group ``i // n``; its seed is derived from the launcher's ``seed``, the
``global_step`` and ``i`` only; its window is the group's, drawn by ``rollout_consistency.schedulers.SDEWindowSchedule`` from
(seed, global_step, group). Rollout batches are consecutive runs of ``rollout_batch_size`` samples. A
batch is the unit of work a worker receives, so the same batches — the same forwards, bit for bit — are
computed whether one worker or sixteen run the check.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

from .settings import SampleSettings, SidesSettings

_SEED_DOMAIN = b"rollout-consistency/sample-seed/v1"


@dataclass(frozen=True)
class SampleSpec:
    """One rollout: global index, prompt, prompt group, seed, and its SDE window ``[start, start+size)``."""

    index: int
    prompt_index: int
    prompt: str
    prompt_group: int
    seed: int
    window_start: int
    window_size: int


@dataclass(frozen=True)
class BatchSpec:
    """One rollout batch (the unit of work of a worker)."""

    index: int
    samples: tuple[SampleSpec, ...]

    @property
    def sample_indices(self) -> tuple[int, ...]:
        return tuple(s.index for s in self.samples)

    def describe(self) -> str:
        first, last = self.samples[0].index, self.samples[-1].index
        groups = sorted({s.prompt_group for s in self.samples})
        return f"rollout batch {self.index} (samples {first}-{last}, prompt groups {groups})"


def sample_seed(seed: int, global_step: int, index: int) -> int:
    """Seed of sample `index` at `global_step` of a run launched with `seed`: 63 bits of SHA-256.

    Pure function of its arguments (never of the process, rank or worker), stable across platforms.
    """
    digest = hashlib.sha256(_SEED_DOMAIN + struct.pack("<qqq", seed, global_step, index)).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def window_schedule(sampling: SampleSettings) -> Any:
    """The `rollout_consistency.schedulers.SDEWindowSchedule` every prompt group's window is drawn from."""
    from rollout_consistency.schedulers import SDEWindowSchedule

    return SDEWindowSchedule(
        kind=sampling.sde_window_kind,
        num_steps=sampling.num_inference_steps,
        window_size=sampling.sde_window_size,
        window_range=sampling.sde_window_range,
    )


def make_plan(settings: SidesSettings) -> tuple[BatchSpec, ...]:
    """The rollout batches of a check, in global sample order."""
    sampling = settings.sampling
    schedule = window_schedule(sampling)
    prompts = sampling.prompts
    samples = []
    for index in range(sampling.num_samples):
        group = index // sampling.num_images_per_prompt
        window = schedule.window(seed=sampling.seed, global_step=sampling.global_step, prompt_group=group)
        samples.append(
            SampleSpec(
                index=index,
                prompt_index=group,
                prompt=prompts[group],
                prompt_group=group,
                seed=sample_seed(sampling.seed, sampling.global_step, index),
                window_start=window.start,
                window_size=window.size,
            )
        )
    size = settings.execution.rollout_batch_size
    return tuple(
        BatchSpec(index=b, samples=tuple(samples[start : start + size]))
        for b, start in enumerate(range(0, len(samples), size))
    )
