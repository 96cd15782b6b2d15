"""mask-sum-rope, true positives: text RoPE lengths from the mask's sum in a vLLM-omni rollout adapter (the
forms verl-omni's Qwen-Image adapters use). Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


class QwenImagePipelineWithLogProb:
    def forward(self, prompt_embeds, prompt_embeds_mask, negative_prompt_embeds, negative_prompt_embeds_mask, latents):
        txt_seq_lens = prompt_embeds_mask.sum(dim=1).tolist() if prompt_embeds_mask is not None else None  # expect: mask-sum-rope
        negative_txt_seq_lens = (
            negative_prompt_embeds_mask.sum(dim=1).tolist() if negative_prompt_embeds_mask is not None else None  # expect: mask-sum-rope
        )
        return self.diffuse(prompt_embeds, latents, txt_seq_lens, negative_txt_seq_lens)

    def prepare_request_state(self, state, prompt_embeds_mask):
        state.txt_seq_lens = prompt_embeds_mask.sum(dim=1).tolist() if prompt_embeds_mask is not None else None  # expect: mask-sum-rope
        return state

    def predict_noise(self, latents, timestep, prompt_embeds, encoder_attention_mask, img_shapes):
        return self.transformer(
            hidden_states=latents,
            timestep=timestep / 1000,
            encoder_hidden_states=prompt_embeds,
            encoder_hidden_states_mask=encoder_attention_mask,
            img_shapes=img_shapes,
            txt_seq_lens=encoder_attention_mask.sum(-1).tolist(),  # expect: mask-sum-rope
            return_dict=False,
        )[0]

    def build_context(self, prompt_embeds, attention_mask):
        lengths = attention_mask.to(torch.int64).sum(dim=1)
        return {"prompt_embeds": prompt_embeds, "txt_seq_lens": lengths.tolist()}  # expect: mask-sum-rope
