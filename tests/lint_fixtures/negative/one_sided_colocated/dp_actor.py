"""The actor of the colocated worker.

Lint fixture: parsed, never imported or run.
"""


class DataParallelPPOActor:
    def __init__(self, config):
        self.config = config

    def update_policy(self, batch):
        return batch
