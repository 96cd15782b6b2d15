"""The verl worker module of positive/verl_omni_like, unchanged: it imports both (fixed) sides.

Lint fixture: parsed, never imported or run.
"""

from .dp_actor import DataParallelDiffusionActor
from .vllm_rollout import vLLMDiffusionRollout


class ActorRolloutRefWorker:
    def init_model(self, config, module, engine, optimizer):
        self.actor = DataParallelDiffusionActor(config, module, optimizer)
        self.rollout = vLLMDiffusionRollout(config, engine)
