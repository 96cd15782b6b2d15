"""mask-sum-rope, false-positive class: a mask's sum that packs a batch (diffusers' CogView4), not a rollout
engine's RoPE length. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


def pack_text(hidden_states, encoder_hidden_states, attention_mask):
    text_attn_mask = attention_mask
    text_seq_length = torch.sum(text_attn_mask, dim=1)
    total = text_seq_length + hidden_states.shape[1]
    return torch.cat([encoder_hidden_states, hidden_states], dim=1), total
