# Copyright 2026 The rollout-consistency authors. Apache-2.0.
"""Qwen-Image text RoPE lengths: the rule, and a labelled reproduction of the stock bug.

The rule (the known pitfall "RoPE sequence length mismatch"): a transformer that takes `txt_seq_lens` must get
the *padded* embedding width for every sample,

    txt_seq_lens = [prompt_embeds.shape[1]] * batch            # padded_txt_seq_lens(prompt_embeds)

because the reference (diffusers >= 0.39's `QwenImageTransformer2DModel`, the trainer) builds the text
RoPE table from `encoder_hidden_states.shape[1]`. Taking the lengths from `mask.sum()` (valid tokens only)
builds a table that stops at the longest valid prompt; when the embeddings are padded wider than that (a
shared width under continuous batching, fixed-width collation), the positions past it get no rotation.

[`QwenImageTransformerTxtSeqLens`] is diffusers' transformer plus the `txt_seq_lens` argument, with
vLLM-omni's rule for it: the text RoPE table is `max(txt_seq_lens)` long. With `txt_seq_lens=None` or the
padded width it is bit-for-bit diffusers' forward (tested).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence

import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

__all__ = [
    "QwenImageTransformerTxtSeqLens",
    "padded_txt_seq_lens",
    "stock_mask_sum_txt_seq_lens",
    "takes_txt_seq_lens",
]


def padded_txt_seq_lens(prompt_embeds: torch.Tensor) -> list[int]:
    """Text RoPE lengths for a batch: the padded width for every sample.

    Args:
        prompt_embeds (`torch.Tensor` of shape `(B, L, D)`): the embeddings exactly as fed to the transformer
            (after any padding to a shared width).

    Returns:
        `[L] * B`.
    """
    if prompt_embeds.dim() != 3:
        raise ValueError(f"prompt_embeds must be (B, L, D), got {tuple(prompt_embeds.shape)}.")
    return [int(prompt_embeds.shape[1])] * int(prompt_embeds.shape[0])


def stock_mask_sum_txt_seq_lens(prompt_embeds_mask: torch.Tensor) -> list[int]:
    """REPRODUCTION of the stock (buggy) rule: lengths from `mask.sum()`, the valid tokens only.

    Kept for tests and `--inject mask-sum-rope`; never use it to build real inputs (use
    [`padded_txt_seq_lens`]).

    Args:
        prompt_embeds_mask (`torch.Tensor` of shape `(B, L)`): 1 for valid tokens, 0 for padding.
    """
    if prompt_embeds_mask.dim() != 2:
        raise ValueError(f"prompt_embeds_mask must be (B, L), got {tuple(prompt_embeds_mask.shape)}.")
    return [int(n) for n in prompt_embeds_mask.to(torch.int64).sum(dim=1).tolist()]


@functools.cache
def _forward_takes_txt_seq_lens(cls: type) -> bool:
    return "txt_seq_lens" in inspect.signature(cls.forward).parameters


def takes_txt_seq_lens(transformer: torch.nn.Module) -> bool:
    """Whether the transformer's forward has a `txt_seq_lens` argument (vLLM-omni's, or ours below); a
    batch-invariant proxy (`adapters.batch_invariance`) answers for the transformer it wraps."""
    from .batch_invariance import BatchInvariant

    if isinstance(transformer, BatchInvariant):
        transformer = transformer.module
    return _forward_takes_txt_seq_lens(type(transformer))


class _RopeFromTxtSeqLens(QwenEmbedRope):
    """QwenEmbedRope whose text table is `max(txt_seq_lens)` long when lengths are set for one forward."""

    txt_seq_lens: list[int] | None = None

    def forward(self, video_fhw, device=None, max_txt_seq_len=None):
        vid_freqs, txt_freqs = super().forward(video_fhw, device=device, max_txt_seq_len=max_txt_seq_len)
        if self.txt_seq_lens is None:
            return vid_freqs, txt_freqs
        width = int(max_txt_seq_len)
        table_len = max(self.txt_seq_lens)
        if table_len > width:
            raise ValueError(f"txt_seq_lens asks for {table_len} text positions but the embeddings are {width} wide.")
        if table_len == width:
            return vid_freqs, txt_freqs
        # The table stops at max(txt_seq_lens): the padded positions past it are not rotated.
        unrotated = torch.ones((width - table_len, txt_freqs.shape[1]), dtype=txt_freqs.dtype, device=txt_freqs.device)
        return vid_freqs, torch.cat([txt_freqs[:table_len], unrotated], dim=0)


class QwenImageTransformerTxtSeqLens(QwenImageTransformer2DModel):
    """diffusers' `QwenImageTransformer2DModel` whose forward also takes `txt_seq_lens` (as vLLM-omni's does).

    Same config, same weights, same `from_pretrained`. `txt_seq_lens` (list of `B` ints, optional): the text
    RoPE table is built `max(txt_seq_lens)` long, positions past it unrotated. `None` or the padded width
    (see [`padded_txt_seq_lens`]) gives exactly diffusers' forward.
    """

    # `wraps` keeps the parent's signature visible to diffusers' ConfigMixin, which reads the config keys
    # from `inspect.signature(cls.__init__)` in `from_config` / `from_pretrained`.
    @functools.wraps(QwenImageTransformer2DModel.__init__)
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not self.config.use_layer3d_rope:
            rope = self.pos_embed
            self.pos_embed = _RopeFromTxtSeqLens(
                theta=rope.theta, axes_dim=list(rope.axes_dim), scale_rope=rope.scale_rope
            )

    def forward(self, *args, txt_seq_lens: Sequence[int] | None = None, **kwargs):
        if txt_seq_lens is None:
            return super().forward(*args, **kwargs)
        if not isinstance(self.pos_embed, _RopeFromTxtSeqLens):
            raise ValueError("txt_seq_lens is not supported with use_layer3d_rope=True.")
        hidden = kwargs.get("encoder_hidden_states")
        if hidden is not None and len(txt_seq_lens) != hidden.shape[0]:
            raise ValueError(f"{len(txt_seq_lens)} txt_seq_lens for a batch of {hidden.shape[0]}.")
        # Set for this one call only; reset even if the forward raises.
        self.pos_embed.txt_seq_lens = [int(n) for n in txt_seq_lens]
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.pos_embed.txt_seq_lens = None
