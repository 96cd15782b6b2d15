"""A DDPO-style config that trains in float32 (`mixed_precision = "no"`): the sampler's input is float32, so
its `prev_sample.type(sample.dtype)` rounds nothing. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from types import SimpleNamespace


def get_config():
    config = SimpleNamespace()
    config.mixed_precision = "no"
    config.sample = SimpleNamespace(num_steps=50, eta=1.0)
    return config
