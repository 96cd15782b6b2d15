"""The tiny offline models (`rollout_consistency.adapters.tiny`) as values a user hands to another process:
every public value of the package pickles (multiprocessing and a spawned process pickle what they send; a local
closure cannot be), and a tiny model read back builds the same transformer and the same conditioning."""

from __future__ import annotations

import importlib
import pickle

import pytest
import torch

from rollout_consistency.adapters import PipelineSettings, tiny

MODULES = [
    "rollout_consistency.adapters.tiny",
    "rollout_consistency.adapters.tiny.qwen_image",
    "rollout_consistency.adapters.tiny.sd3_flux",
    "rollout_consistency.adapters.tiny.wan",
]
PUBLIC = [(module, name) for module in MODULES for name in importlib.import_module(module).__all__]
TINY_MODELS = [name for name in tiny.__all__ if isinstance(getattr(tiny, name), tiny.TinyModel)]


def test_the_built_in_tiny_models_are_all_listed():
    assert TINY_MODELS == ["TINY_FLUX", "TINY_QWEN_IMAGE", "TINY_SD3", "TINY_WAN"]


@pytest.mark.parametrize(("module", "name"), PUBLIC, ids=[f"{m.rsplit('.', 1)[-1]}.{n}" for m, n in PUBLIC])
def test_every_public_value_pickles(module, name):
    value = getattr(importlib.import_module(module), name)
    assert pickle.loads(pickle.dumps(value)) is not None


@pytest.mark.parametrize("name", TINY_MODELS)
def test_a_tiny_model_read_back_from_pickle_builds_the_same_model(name):
    """Parameters equal bit for bit (same seed, same process), and the prompt encoder it builds gives the same
    conditioning (with the negative prompts of CFG)."""
    original = getattr(tiny, name)
    copy = pickle.loads(pickle.dumps(original))
    assert copy is not original
    models = [t.load_transformer(seed=3) for t in (original, copy)]
    assert type(models[0]) is type(models[1])
    (first, second) = (dict(m.named_parameters()) for m in models)
    assert first.keys() == second.keys() and first
    for key, parameter in first.items():
        assert parameter.dtype == second[key].dtype and torch.equal(parameter, second[key]), key
    settings = PipelineSettings(height=32, width=32, max_sequence_length=16)
    prompts, negative = ["a red cube on a table", "two cats"], ["", "blurry"]
    conditionings = [
        t.prompt_encoder(m, settings)(prompts, negative) for t, m in zip((original, copy), models, strict=True)
    ]
    assert conditionings[0].keys() == conditionings[1].keys()
    for key, value in conditionings[0].items():
        other = conditionings[1][key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key
