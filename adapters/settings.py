# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Frozen settings objects that travel instead of long parameter lists.

* [`PipelineSettings`]: what a launcher asks of a family's pipeline (image size, guidance, text length) — the
  checker turns its config into one and each [`ModelFamily`](rollout_consistency.adapters.families.ModelFamily)
  maps it to its own options, guidance and forwards per step.
* [`SamplingSettings`]: how every SDE step of a rollout is sampled and scored (noise level, SDE type, guidance,
  normaliser).
* [`BatchRequests`]: who the samples of a rollout batch are (seeds, SDE windows, prompt groups, training step).

A rollout (`rollout_consistency.adapters.rollout`, the families' `rollout`, the vLLM-omni client) takes
`requests=BatchRequests(...)` and `sampling=SamplingSettings(...)`, the step-wise engine and its per-request
helpers (`rollout_consistency.adapters.stepwise`) take `sampling=SamplingSettings(...)`; a
[`Trajectory`](rollout_consistency.adapters.trajectory.Trajectory) gives both back as `.requests` / `.sampling`.

Each object checks its settings when it is built, and nothing downstream checks them again: a function that
takes a `SamplingSettings` has usable ones. The sampling rules themselves are
`rollout_consistency.base.sampling_rules.sampling_problem`, which the checker's settings call too.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from rollout_consistency.base.sampling_rules import sampling_problem
from rollout_consistency.schedulers import SDEWindow

__all__ = ["BatchRequests", "PipelineSettings", "SamplingSettings"]


@dataclass(frozen=True)
class PipelineSettings:
    """A family pipeline's call arguments, family-agnostic (each family reads the ones it has).

    Attributes:
        height, width: image (or video frame) size in pixels.
        num_frames: video frames (Wan; image families ignore it).
        guidance_scale: the pipeline's `guidance_scale` (SD3, Wan: classifier-free guidance; FLUX: the embedded
            guidance value; Qwen-Image: unused).
        guidance_scale_2: Wan 2.2's CFG scale for the low-noise expert (`None`: the same as `guidance_scale`).
        boundary_ratio: Wan 2.2's expert switch (`transformer` for timesteps >= boundary_ratio · 1000,
            `transformer_2` below); `None`: the model directory's own (a tiny model then has one expert).
        true_cfg_scale: true classifier-free guidance (Qwen-Image, FLUX); CFG runs when > 1.
        mask_text_padding: pass the text mask to attention (Qwen-Image).
        max_sequence_length: the text encoder's maximum (SD3/FLUX: fixed) token length.
        pad_prompts_to_max_length: pad every prompt to `max_sequence_length` (Qwen-Image; SD3/FLUX always are).
    """

    height: int
    width: int
    guidance_scale: float = 1.0
    true_cfg_scale: float = 1.0
    mask_text_padding: bool = True
    max_sequence_length: int = 512
    pad_prompts_to_max_length: bool = False
    num_frames: int = 13
    guidance_scale_2: float | None = None
    boundary_ratio: float | None = None


@dataclass(frozen=True)
class SamplingSettings:
    """How every SDE step of a rollout is sampled and scored (the same for every sample of the batch).

    Attributes:
        noise_level (`float`): SDE noise level; a rollout with log-probs needs it > 0.
        sde_type (`str`, defaults to `"sde"`): the scheduler's SDE, `"sde"`, `"cps"` or `"dance_sde"`.
        guidance_scale (`float`, defaults to 1.0): the forward's guidance (Qwen-Image / SD3: CFG scale, CFG when
            > 1 and then needs negative conditioning; FLUX: the embedded guidance, `FluxPipeline` uses 3.5).
        include_normalizer (`bool`, defaults to `True`): whether log-probs include the Gaussian normaliser.
    """

    noise_level: float
    sde_type: str = "sde"
    guidance_scale: float = 1.0
    include_normalizer: bool = True

    def __post_init__(self) -> None:
        problem = sampling_problem(self.noise_level, self.sde_type, self.guidance_scale)
        if problem:
            raise ValueError(problem)
        if not isinstance(self.include_normalizer, bool):
            raise ValueError(f"'include_normalizer' must be True or False, got {self.include_normalizer!r}.")
        object.__setattr__(self, "noise_level", float(self.noise_level))
        object.__setattr__(self, "guidance_scale", float(self.guidance_scale))

    @classmethod
    def of(cls, source: Any) -> SamplingSettings:
        """The settings an object that stores them as its own fields carries (a `Trajectory`, vLLM-omni's
        wire `BatchSettings`), checked as any."""
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class BatchRequests:
    """Who the samples of a rollout batch are: one entry per sample, `B = len(seeds)`.

    Sequences are stored as tuples (a list given to the constructor is converted).

    Attributes:
        seeds (`tuple[int, ...]` of length `B`): per-sample seed of the initial and the SDE noise (see
            `rollout_consistency.adapters.rollout` for how a seed maps to draws).
        windows (`SDEWindow` or `tuple[SDEWindow, ...]` of length `B`): one window for every sample, or one per
            sample (samples of a prompt group must share it). `None` only for
            `rollout_consistency.adapters.vllm_omni.build_requests`, where the engine derives each window from
            the launcher's seed.
        prompt_groups (`tuple[int, ...]` of length `B`, *optional*): per-sample prompt-group id; `None`: each
            sample its own group.
        global_step (`int`, defaults to 0): the training step (stored in the trajectory).
        launcher_seed (`int`, *optional*): the launcher's seed that windows are drawn from (with the global step
            and the prompt group); only `rollout_consistency.adapters.vllm_omni.build_requests` reads it, so the
            engine can re-derive each window.
        denoise_to_end (`bool`, defaults to `True`): also run the steps after the last window and store the
            final latents (for the reward); `False` stops after the last window step (the step-1 check needs
            only the windows). The step-wise and vLLM-omni engines always denoise to the end.

    Raises:
        TypeError / ValueError: no seeds, a seed or prompt group that is not an int, a prompt group per sample
            missing, windows that are not one `SDEWindow` or one per sample, or a `global_step` below 0.
    """

    seeds: tuple[int, ...]
    windows: SDEWindow | tuple[SDEWindow, ...] | None
    prompt_groups: tuple[int, ...] | None = None
    global_step: int = 0
    denoise_to_end: bool = True
    launcher_seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        if self.prompt_groups is not None:
            object.__setattr__(self, "prompt_groups", tuple(self.prompt_groups))
        if not self.seeds:
            raise ValueError("A rollout needs at least one sample (one seed per sample).")
        for name in ("seeds", "prompt_groups"):
            values = getattr(self, name)
            if values is not None and not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                raise TypeError(f"BatchRequests.{name} must hold ints (one per sample), got {tuple(values)!r}.")
        if self.windows is not None and not isinstance(self.windows, SDEWindow):
            windows = tuple(self.windows)
            if not all(isinstance(w, SDEWindow) for w in windows):
                raise TypeError(
                    f"Expected SDEWindow, got {windows!r}; build one with rollout_consistency.schedulers.draw_sde_window(...)."
                )
            if len(windows) != len(self.seeds):
                raise ValueError(
                    f"{len(windows)} windows for {len(self.seeds)} samples: pass one window, or one per sample."
                )
            object.__setattr__(self, "windows", windows)
        if self.prompt_groups is not None and len(self.prompt_groups) != len(self.seeds):
            raise ValueError(
                f"{len(self.prompt_groups)} prompt groups for {len(self.seeds)} seeds: pass one per sample."
            )
        if not isinstance(self.global_step, int) or isinstance(self.global_step, bool) or self.global_step < 0:
            raise ValueError(f"global_step must be an int >= 0, got {self.global_step!r}.")
        if self.launcher_seed is not None and (
            not isinstance(self.launcher_seed, int) or isinstance(self.launcher_seed, bool)
        ):
            raise TypeError(f"BatchRequests.launcher_seed must be an int or None, got {self.launcher_seed!r}.")
        if not isinstance(self.denoise_to_end, bool):
            raise ValueError(f"denoise_to_end must be True or False, got {self.denoise_to_end!r}.")

    @property
    def groups(self) -> tuple[int, ...]:
        """Each sample's prompt group (`prompt_groups`, or each sample its own group when it is `None`)."""
        return tuple(range(len(self.seeds))) if self.prompt_groups is None else self.prompt_groups
