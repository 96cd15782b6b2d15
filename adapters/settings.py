# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Frozen settings objects that travel instead of long parameter lists.

* [`PipelineSettings`]: what a launcher asks of a family's pipeline (image size, guidance, text length) — the
  checker turns its config into one and each [`ModelFamily`](rollout_consistency.adapters.families.ModelFamily)
  maps it to its own options, guidance and forwards per step.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineSettings"]


@dataclass(frozen=True)
class PipelineSettings:
    """A family pipeline's call arguments, family-agnostic (each family reads the ones it has).

    Attributes:
        height, width: image size in pixels.
        guidance_scale: the pipeline's `guidance_scale` (SD3: classifier-free guidance; FLUX: the embedded
            guidance value; Qwen-Image: unused).
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
