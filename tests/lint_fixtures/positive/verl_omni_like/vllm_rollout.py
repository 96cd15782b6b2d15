"""Shaped like a verl + vLLM-omni diffusion rollout worker (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import random

import torch


class vLLMDiffusionRollout:
    def __init__(self, config, engine):
        self.config = config
        self.engine = engine
        torch.backends.cuda.matmul.allow_tf32 = True  # expect: one-sided-precision-flag

    def _sde_window(self, request_id, num_steps):
        rng = random.Random(hash(request_id) ^ self.config.seed)  # expect: non-launcher-seed
        start = rng.randint(0, num_steps - self.config.sde_window_size)
        return range(start, start + self.config.sde_window_size)

    def _forward(self, latents, timestep, prompt_embeds, prompt_embeds_mask):
        txt_seq_lens = prompt_embeds_mask.sum(dim=1).tolist()  # expect: mask-sum-rope
        return self.engine.transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=prompt_embeds,
            encoder_hidden_states_mask=prompt_embeds_mask,
            txt_seq_lens=txt_seq_lens,
        )

    def generate_sequences(self, prompts):
        outputs = []
        for request_id, prompt in enumerate(prompts):
            window = self._sde_window(str(request_id), self.config.num_inference_steps)  # expect: non-launcher-seed
            outputs.append(self.engine.generate(prompt, sde_window=window))
        return outputs
