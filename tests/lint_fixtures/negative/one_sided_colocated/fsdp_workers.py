"""one-sided-precision-flag, false-positive class: a colocated worker (verl's hybrid engine) runs the actor
and the rollout in one process, so a flag set while generating is the actor's too. Written for the lint's
tests.

Lint fixture: parsed, never imported or run.
"""

import torch

from dp_actor import DataParallelPPOActor


class ActorRolloutRefWorker:
    def generate_sequences(self, prompts):
        torch.backends.cudnn.allow_tf32 = True
        return self.rollout.generate(prompts)

    def update_actor(self, batch):
        self.actor = self.actor or DataParallelPPOActor(self.config)
        return self.actor.update_policy(batch)
