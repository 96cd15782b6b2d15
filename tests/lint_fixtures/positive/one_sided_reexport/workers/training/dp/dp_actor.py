"""The trainer's actor: sets no TF32 flag. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""


class DataParallelPPOActor:
    def __init__(self, config):
        self.config = config

    def compute_log_prob(self, data):
        return self.config.model(data)
