"""A verl-style worker module that takes both sides from their packages' indexes (`from workers.rollout import
vLLMRollout`): the imports lead on to the modules that define them. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from workers.training import DataParallelPPOActor
from workers.rollout import vLLMRollout


class ActorRolloutRefWorker:
    def __init__(self, config, role):
        self.actor = DataParallelPPOActor(config) if "actor" in role else None
        self.rollout = vLLMRollout(config) if "rollout" in role else None
