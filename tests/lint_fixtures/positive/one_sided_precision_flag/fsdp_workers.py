"""one-sided-precision-flag: the worker module that holds both sides (it imports them: one program).
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch

from .dp_actor import DataParallelDiffusionActor
from .vllm_rollout import vLLMDiffusionRollout


class ActorRolloutRefWorker:
    def __init__(self, config, role):
        self.config = config
        self.role = role

    def init_model(self, module, engine):
        if self.role == "rollout":
            torch.backends.cudnn.deterministic = True  # expect: one-sided-precision-flag
            self.rollout = vLLMDiffusionRollout(self.config, engine)
        else:
            self.actor = DataParallelDiffusionActor(self.config, module)
