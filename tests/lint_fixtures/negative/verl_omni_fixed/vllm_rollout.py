"""The verl + vLLM-omni rollout worker of positive/verl_omni_like, fixed: nothing here may be reported.

Lint fixture: parsed, never imported or run.
"""

import hashlib

import torch


def draw_sde_window(seed, global_step, prompt_group, num_steps, window_size):
    digest = hashlib.sha256(f"{seed}/{global_step}/{prompt_group}".encode()).digest()
    start = int.from_bytes(digest[:8], "little") % (num_steps - window_size + 1)
    return range(start, start + window_size)


class vLLMDiffusionRollout:
    def __init__(self, config, engine):
        self.config = config
        self.engine = engine
        torch.backends.cuda.matmul.allow_tf32 = False

    def _forward(self, latents, timestep, prompt_embeds, prompt_embeds_mask):
        txt_seq_lens = [prompt_embeds.shape[1]] * prompt_embeds.shape[0]
        return self.engine.transformer(
            hidden_states=latents.to(self.engine.dtype),
            timestep=timestep,
            encoder_hidden_states=prompt_embeds,
            encoder_hidden_states_mask=prompt_embeds_mask,
            txt_seq_lens=txt_seq_lens,
        )

    def generate_sequences(self, prompts, global_step):
        outputs = []
        for index, prompt in enumerate(prompts):
            group = index // self.config.num_images_per_prompt
            window = draw_sde_window(
                self.config.seed, global_step, group, self.config.num_inference_steps, self.config.sde_window_size
            )
            outputs.append(self.engine.generate(prompt, sde_window=window))
        return outputs
