"""mask-sum-rope near misses inside rollout-engine code: a mask's sum used for something else than the text
RoPE length, and the fix. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""


def padded_width(prompt_embeds, prompt_embeds_mask):
    """The fix: the padded width, for every row."""
    batch_size = prompt_embeds.shape[0]
    txt_seq_lens = [prompt_embeds.shape[1]] * batch_size
    return prompt_embeds, prompt_embeds_mask, txt_seq_lens


def trim_to_longest(prompt_embeds, prompt_embeds_mask):
    """Trimming the padding to the longest prompt uses the mask's sum, then the RoPE gets the trimmed width."""
    max_len = int(prompt_embeds_mask.sum(dim=1).max())
    prompt_embeds = prompt_embeds[:, :max_len]
    prompt_embeds_mask = prompt_embeds_mask[:, :max_len]
    txt_seq_lens = [prompt_embeds.shape[1]] * prompt_embeds.shape[0]
    return prompt_embeds, prompt_embeds_mask, txt_seq_lens


def mean_pool(embeds, mask):
    return (embeds * mask[..., None]).sum(dim=1) / mask.sum(dim=1, keepdim=True)


def token_statistics(attention_mask):
    valid_tokens = attention_mask.sum(dim=1)
    padding_fraction = 1.0 - valid_tokens.float().mean() / attention_mask.shape[1]
    return valid_tokens, padding_fraction


def forward(transformer, latents, prompt_embeds, prompt_embeds_mask):
    return transformer(
        hidden_states=latents,
        encoder_hidden_states=prompt_embeds,
        encoder_hidden_states_mask=prompt_embeds_mask,
        txt_seq_lens=[prompt_embeds.shape[1]] * latents.shape[0],
    )
