# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Frozen settings objects that travel instead of long parameter lists.

* [`PipelineSettings`]: what a launcher asks of a family's pipeline (image size, guidance, text length) — the
  checker turns its config into one and each [`ModelFamily`](rollout_consistency.adapters.families.ModelFamily)
  maps it to its own options, guidance and forwards per step.
* [`SamplingSettings`]: how every SDE step of a rollout is sampled and scored (noise level, SDE type, guidance,
  normaliser).
* [`BatchRequests`]: who the samples of a rollout batch are (seeds, SDE windows, prompt groups, training step).

A rollout (`rollout_consistency.adapters.rollout`, the families' `rollout`, `stepwise.run_stepwise`, the
vLLM-omni client) takes `requests=BatchRequests(...)` and `sampling=SamplingSettings(...)`; a
[`Trajectory`](rollout_consistency.adapters.trajectory.Trajectory) gives both back as `.requests` / `.sampling`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """

    seeds: tuple[int, ...]
    windows: SDEWindow | tuple[SDEWindow, ...] | None
    prompt_groups: tuple[int, ...] | None = None
    global_step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "seeds", tuple(self.seeds))
        if self.windows is not None and not isinstance(self.windows, SDEWindow):
            object.__setattr__(self, "windows", tuple(self.windows))
        if self.prompt_groups is not None:
            object.__setattr__(self, "prompt_groups", tuple(self.prompt_groups))
