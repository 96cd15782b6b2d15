"""one-sided-precision-flag, sides by class, method and condition in a file named for neither.

Lint fixture: parsed, never imported or run.
"""

import torch


class ActorRolloutRefWorker:
    def generate_sequences(self, prompts):
        torch.backends.cudnn.allow_tf32 = True  # expect: one-sided-precision-flag
        return self.rollout.generate(prompts)

    def update_actor(self, batch):
        return self.actor.update(batch)


def init_process(role):
    if role == "rollout":
        torch.backends.cudnn.deterministic = True  # expect: one-sided-precision-flag
