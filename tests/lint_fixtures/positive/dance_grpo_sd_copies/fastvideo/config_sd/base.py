"""DanceGRPO's SD config (ml_collections in the original; a plain namespace here): bf16 mixed precision, so the
sampler's input is bf16. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from types import SimpleNamespace


def get_config():
    config = SimpleNamespace()
    config.mixed_precision = "bf16"
    config.sample = SimpleNamespace(num_steps=50, eta=1.0, guidance_scale=5.0)
    config.train = SimpleNamespace(clip_range=1e-4, adv_clip_max=5)
    return config
