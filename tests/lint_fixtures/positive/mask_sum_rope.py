"""mask-sum-rope: every line marked `# expect: <rule>` must be reported (and nothing else).

Lint fixture: parsed, never imported or run.
"""

import torch


def prepare_text_inputs(prompt_embeds, prompt_embeds_mask):
    txt_seq_lens = prompt_embeds_mask.sum(dim=1).tolist()  # expect: mask-sum-rope
    return prompt_embeds, txt_seq_lens


def forward_with_keyword(transformer, latents, timestep, prompt_embeds, encoder_attention_mask):
    return transformer(
        hidden_states=latents,
        timestep=timestep,
        encoder_hidden_states=prompt_embeds,
        txt_seq_lens=encoder_attention_mask.sum(-1).tolist(),  # expect: mask-sum-rope
    )


def forward_through_a_name(self, latents, timestep, prompt_embeds, attention_mask):
    lengths = attention_mask.to(torch.int64).sum(dim=1)
    return self.transformer(
        hidden_states=latents,
        encoder_hidden_states=prompt_embeds,
        timestep=timestep,
        txt_seq_lens=lengths.tolist(),  # expect: mask-sum-rope
    )


def text_seq_lens_of(mask):
    return [int(n) for n in torch.sum(mask, dim=1)]  # expect: mask-sum-rope


class TextEncoderOutput:
    def __init__(self, embeds, text_mask):
        self.embeds = embeds
        self.encoder_seq_lens: list[int] = torch.count_nonzero(text_mask, dim=1).tolist()  # expect: mask-sum-rope
