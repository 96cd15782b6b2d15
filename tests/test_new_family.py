"""A model family registered from outside the package (here: this test module) runs through the rollout, the
trainer's recompute, the step-wise engine, the trajectory file and the checker, with no change to the package.

The family is a renamed copy of Qwen-Image's functions: one module of functions plus `register_family` (and,
for the checker's offline run, `register_tiny`), as docs/adapters.md shows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout_consistency import run_step1_check
from rollout_consistency.adapters import (
    BatchRequests,
    SamplingSettings,
    Trajectory,
    family_names,
    get_family,
    qwen_image,
    recompute_log_probs,
    register_family,
    rollout,
    tiny,
)
from rollout_consistency.adapters.stepwise import EngineSettings, StepwiseRequest, run_stepwise
from rollout_consistency.schedulers import SDEWindow


def toy_velocity(transformer, latents, timesteps, conditioning, guidance_scale, *, options):
    """The new family's velocity: here Qwen-Image's, under another name."""
    return qwen_image.velocity(transformer, latents, timesteps, conditioning, guidance_scale, options=options)


TOY = register_family(dataclasses.replace(qwen_image.FAMILY, name="toy-qwen", velocity=toy_velocity))
tiny.register_tiny("toy-qwen", tiny.get_tiny("qwen-image"))
OPTIONS = {"height": 32, "width": 32}


@pytest.fixture(scope="module")
def model_and_conditioning():
    model = tiny.load_qwen_image(seed=0)
    conditioning = tiny.TinyPromptEncoder(32, seed=0).conditioning(["a red cube", "a blue sphere on grass"])
    return model, conditioning


def test_registered_family_is_found_by_name_and_names_are_guarded():
    assert get_family("toy-qwen") is TOY and "toy-qwen" in family_names()
    assert register_family(TOY) is TOY  # the same object again: a no-op
    with pytest.raises(ValueError, match="already registered"):
        register_family(dataclasses.replace(TOY, velocity=qwen_image.velocity))
    with pytest.raises(ValueError, match="register_family"):
        get_family("no-such-family")
    with pytest.raises(TypeError, match="ModelFamily"):
        register_family(qwen_image)  # a module is not a ModelFamily


def test_rollout_file_and_recompute_of_a_registered_family(model_and_conditioning, tmp_path):
    model, conditioning = model_and_conditioning
    setup = TOY.scheduler_setup(qwen_image.QWEN_IMAGE_SCHEDULER_CONFIG, 6, model, OPTIONS)
    trajectory = rollout(
        TOY,
        model,
        conditioning,
        scheduler_setup=setup,
        requests=BatchRequests(seeds=[1, 2], windows=SDEWindow(1, 2, 6)),
        sampling=SamplingSettings(noise_level=0.7),
        options=OPTIONS,
    )
    assert trajectory.model_family == "toy-qwen"
    trajectory.save(tmp_path / "toy.safetensors")
    loaded = Trajectory.load(tmp_path / "toy.safetensors")
    # Same code, same inputs, same batch composition: the contract's bit-for-bit case.
    with torch.no_grad():
        assert torch.equal(recompute_log_probs(model, loaded), trajectory.log_probs)  # family found by name
    # The same functions under the built-in name give the same numbers: the family is only a name here.
    builtin = rollout(
        qwen_image.FAMILY,
        model,
        conditioning,
        scheduler_setup=setup,
        requests=BatchRequests(seeds=[1, 2], windows=SDEWindow(1, 2, 6)),
        sampling=SamplingSettings(noise_level=0.7),
        options=OPTIONS,
    )
    assert torch.equal(builtin.log_probs, trajectory.log_probs)


def test_stepwise_engine_stacks_a_registered_family(model_and_conditioning):
    model, conditioning = model_and_conditioning
    setup = TOY.scheduler_setup(qwen_image.QWEN_IMAGE_SCHEDULER_CONFIG, 6, model, OPTIONS)
    rows = [{k: v[i : i + 1] for k, v in conditioning.items()} for i in range(2)]
    requests = [
        StepwiseRequest(f"r{i}", seed=i + 1, conditioning=row, window=SDEWindow(1, 2, 6)) for i, row in enumerate(rows)
    ]
    trajectory = run_stepwise(
        TOY,
        model,
        requests,
        scheduler_setup=setup,
        sampling=SamplingSettings(noise_level=0.7),
        options=OPTIONS,
        engine=EngineSettings(max_num_seqs=2),
    )
    assert trajectory.model_family == "toy-qwen" and trajectory.batch_size == 2


@pytest.mark.parametrize("step_execution", [False, True], ids=["request-level", "step-wise"])
def test_checker_runs_a_registered_family(step_execution):
    report = run_step1_check(
        model_family="toy-qwen",
        step_execution=step_execution,
        max_num_seqs=2,
        progress=False,
        num_prompts=2,
        num_images_per_prompt=2,
        rollout_batch_size=2,
    )
    assert report.passed, report.format_table()
    overall = report.metrics.overall
    assert overall.max_abs_dlogp == 0 and overall.ratio_mean == 1 and overall.ppo_kl == 0
    assert report.config["model_family"] == "toy-qwen"
