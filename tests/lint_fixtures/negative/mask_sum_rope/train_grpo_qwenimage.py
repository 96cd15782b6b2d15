"""mask-sum-rope, false-positive class: a trainer that samples and trains in one process (DanceGRPO style).
Sampling and training pass the same lengths to the same diffusers transformer, whose RoPE fails loudly when
they do not cover the embeddings, so the two sides cannot disagree. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


def sample_reference_model(args, transformer, encoder_hidden_states, batch_prompt_attention_mask, input_latents):
    txt_seq_lens = batch_prompt_attention_mask.sum(dim=1).tolist()
    with torch.no_grad():
        return run_sample_step(args, input_latents, transformer, encoder_hidden_states, txt_seq_lens), txt_seq_lens


def grpo_one_step(args, latents, pre_latents, encoder_hidden_states, prompt_attention_mask, transformer, timesteps):
    with torch.autocast("cuda", torch.bfloat16):
        pred = transformer(
            hidden_states=latents,
            encoder_hidden_states=encoder_hidden_states,
            encoder_hidden_states_mask=prompt_attention_mask,
            timestep=timesteps / 1000,
            txt_seq_lens=prompt_attention_mask.sum(dim=1).tolist(),
            return_dict=False,
        )[0]
    return pred


def compute_log_prob(transformer, pipeline, sample, j, config):
    txt_seq_lens = sample["prompt_embeds_mask"].sum(dim=1).tolist()
    # the embeddings are trimmed to the longest valid prompt, so the RoPE table covers them
    width = max(txt_seq_lens)
    return transformer(
        hidden_states=sample["latents"][:, j],
        encoder_hidden_states=sample["prompt_embeds"][:, :width],
        txt_seq_lens=txt_seq_lens,
    )
