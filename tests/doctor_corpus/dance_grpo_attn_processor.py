"""DanceGRPO (FLUX): the sampler swaps in its own attention processor, a copy of FluxAttnProcessor that runs the
attention itself in bfloat16 (the input dtype of the flash-attention kernel it was written for); the trainer keeps
diffusers' FluxAttnProcessor."""

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from doctor_corpus.loops import DanceGRPOSampler, DanceGRPOTrainer, settings

CASE = dict(expected="attention-processor", side="rollout", settings=settings("dance_grpo"))


class FlashFluxAttnProcessor(FluxAttnProcessor):
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        heads = lambda x: x.unflatten(-1, (-1, attn.head_dim))  # noqa: E731
        query = attn.norm_q(heads(attn.to_q(hidden_states)))
        key = attn.norm_k(heads(attn.to_k(hidden_states)))
        value = heads(attn.to_v(hidden_states))
        if encoder_hidden_states is not None:
            query = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states))), query], dim=1)
            key = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states))), key], dim=1)
            value = torch.cat([heads(attn.add_v_proj(encoder_hidden_states)), value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        # the bug: the kernel's bfloat16 inputs (the trainer's processor attends in float32)
        q, k, v = (x.transpose(1, 2).to(torch.bfloat16) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        context, out = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        return attn.to_out[1](attn.to_out[0](out)), attn.to_add_out(context)


class Sampler(DanceGRPOSampler):
    def __init__(self, config):
        super().__init__(config)
        self.transformer.set_attn_processor(FlashFluxAttnProcessor())


def make_rollout(config):
    return Sampler(config)


def make_trainer(config):
    return DanceGRPOTrainer(config)
