"""non-launcher-seed, false-positive class: a profiler's schedule window, in a file that never names the
stochastic sampler or its noise level. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import torch


class Profiler:
    def __init__(self, rank, config):
        self.rank = rank
        self.window = config.active_steps * (rank + 1)

    def stop(self, prof):
        self._flush_partial_window(prof, rank=self.rank)
        window_start = self.rank * self.window
        return torch.profiler.schedule(wait=window_start, warmup=1, active=self.window)
