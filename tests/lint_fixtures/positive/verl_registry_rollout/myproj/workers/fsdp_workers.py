"""The actor-rollout worker: the rollout class comes from the registry by the config's name, the actor
re-scores the stored step (written for the lint's tests).

Lint fixture: parsed, never imported or run.
"""

import torch

from myproj.rollout.registry import get_rollout_class


class ActorRolloutRefWorker:
    def __init__(self, config):
        self.config = config
        self.rollout = get_rollout_class(config.rollout)(config)

    def generate_sequences(self, prompts):
        return self.rollout.generate_sequences(prompts)

    def update_actor(self, batch):
        log_prob = self.rollout.score(batch["latents"], batch["next_latents"], batch["timesteps"])
        ratio = torch.exp(log_prob - batch["old_log_probs"])
        loss = -(batch["advantages"] * ratio).mean()
        loss.backward()
