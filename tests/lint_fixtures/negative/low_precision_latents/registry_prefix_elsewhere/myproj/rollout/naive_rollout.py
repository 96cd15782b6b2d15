"""The rollout the registry loads by name (`rollout: naive`): float32 latents throughout (written for the
lint's tests).

Lint fixture: parsed, never imported or run.
"""

import torch


class Rollout:
    def __init__(self, config):
        self.config = config

    def generate_sequences(self, prompts):
        latents = self.config.initial_latents(prompts).float()
        all_latents = [latents]
        for index in range(self.config.num_steps):
            latents = latents + self.config.transformer(latents, index, prompts).float() * self.config.dt
            all_latents.append(latents)
        return {"latents": torch.stack(all_latents, dim=1)}
