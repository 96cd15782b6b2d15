"""Shaped like verl's worker module (written for the lint's tests): it imports both sides, one program.

Lint fixture: parsed, never imported or run.
"""

from .dp_actor import DataParallelDiffusionActor
from .vllm_rollout import vLLMDiffusionRollout


class ActorRolloutRefWorker:
    def init_model(self, config, module, engine, optimizer):
        self.actor = DataParallelDiffusionActor(config, module, optimizer)
        self.rollout = vLLMDiffusionRollout(config, engine)
