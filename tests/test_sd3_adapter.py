"""SD3-only adapter tests: the CFG arithmetic, per-sample windows, latent and image-size checks, a trajectory of
another family. What SD3 shares with FLUX (pipeline parity, bit-exact recompute, the bf16 pitfall, bad
conditioning, the tiny models) is tested for both in tests/test_sd3_flux_adapters.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from sd3_flux_cases import PROMPTS, SD3, SEEDS, SIZE, recompute, rollout

from rollout_consistency.adapters import BatchRequests, SamplingSettings, flux, sd3
from rollout_consistency.adapters.tiny.sd3_flux import TINY_SD3_CONFIG, load_flux, load_sd3, tiny_flux_prompt_encoder
from rollout_consistency.schedulers import SDEWindow

_rollout = partial(rollout, SD3)
_recompute = partial(recompute, SD3)


@pytest.fixture(scope="module")
def model():
    return load_sd3()


@pytest.fixture(scope="module")
def cond():
    return SD3.conditioning(PROMPTS, [""] * len(PROMPTS))


def test_per_sample_windows_recompute_exactly(model, cond):
    """Two prompt groups with different windows: the recompute batches samples at different timesteps."""
    windows = [SDEWindow(1, 2, 6), SDEWindow(1, 2, 6), SDEWindow(3, 2, 6), SDEWindow(3, 2, 6)]
    trajectory = _rollout(model, cond, window=windows, prompt_groups=[0, 0, 1, 1])
    assert trajectory.timesteps[0, 0] != trajectory.timesteps[2, 0]
    assert torch.equal(_recompute(model, trajectory), trajectory.log_probs)


def test_cfg_runs_the_conditional_forward_unchanged(model, cond):
    """CFG is uncond + s·(cond − uncond) of two forwards; at s = 1 it is the conditional forward exactly."""
    latents = torch.randn(4, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    t = torch.full((4,), 750.0)
    with torch.no_grad():
        cond_only = sd3.velocity(model, latents, t, cond, 1.0, options=SIZE)
        guided = sd3.velocity(model, latents, t, cond, 4.5, options=SIZE)
        no_negative = {k: v for k, v in cond.items() if not k.startswith("negative")}
        assert torch.equal(sd3.velocity(model, latents, t, no_negative, 1.0, options=SIZE), cond_only)
        uncond = sd3.velocity(
            model,
            latents,
            t,
            {
                "prompt_embeds": cond["negative_prompt_embeds"],
                "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"],
            },
            1.0,
            options=SIZE,
        )
    assert guided.dtype == torch.float32
    assert torch.equal(guided, uncond + 4.5 * (cond_only - uncond))


# ---------------------------------------------------------------------------------------------- bad inputs
def test_wrong_latent_shape_is_refused(model, cond):
    trajectory = _rollout(model, cond)
    t = trajectory.timesteps[:, 0]
    with pytest.raises(ValueError, match="do not fit this SD3 transformer"):
        sd3.velocity(model, torch.zeros(4, 4, 8, 8), t, cond, 1.0, options=SIZE)  # 4 channels, model takes 16
    with pytest.raises(TypeError, match="float32"):
        sd3.velocity(model, trajectory.latents[:, 0].bfloat16(), t, cond, 1.0, options=SIZE)
    other_size = load_sd3(config={**TINY_SD3_CONFIG, "in_channels": 8, "out_channels": 8})
    with pytest.raises(ValueError, match="wrong latent shape for the model"):
        _recompute(other_size, trajectory)


def test_image_size_is_checked(model, cond):
    with pytest.raises(ValueError, match="multiples of vae_scale_factor"):
        _rollout(model, cond, height=60)
    with pytest.raises(ValueError, match="pos_embed_max_size"):
        _rollout(model, cond, height=512, width=512)


def test_trajectory_of_another_family_is_refused(model, cond):
    other = flux.rollout(
        load_flux(),
        tiny_flux_prompt_encoder().conditioning(PROMPTS),
        num_inference_steps=4,
        requests=BatchRequests(seeds=SEEDS, windows=SDEWindow(0, 2, 4)),
        sampling=SamplingSettings(noise_level=0.7, guidance_scale=3.5),
        **SIZE,
    )
    with pytest.raises(ValueError, match="'flux' rollout"):
        _recompute(model, other)
