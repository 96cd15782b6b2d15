"""Part of a single-process trainer: named for the rollout, it runs in the trainer's process.

Lint fixture: parsed, never imported or run.
"""


class RolloutBuffer:
    def __init__(self):
        self.samples = []

    def add(self, sample):
        self.samples.append(sample)
