"""A DDPO-style config (ml_collections in the original lineage; a plain namespace here). Written for the lint's
tests: its mixed-precision setting is what makes the sampler's input fp16.

Lint fixture: parsed, never imported or run.
"""

from types import SimpleNamespace


def get_config():
    config = SimpleNamespace()
    config.seed = 42
    config.mixed_precision = "fp16"
    config.sample = SimpleNamespace(num_steps=50, eta=1.0, guidance_scale=5.0, batch_size=8)
    config.train = SimpleNamespace(learning_rate=3e-4, clip_range=1e-4, adv_clip_max=5)
    return config
