"""FLUX-only adapter tests: 2x2 packing and image ids, embedded guidance and true CFG, latent and image-size
checks. What FLUX shares with SD3 (pipeline parity, bit-exact recompute, the bf16 pitfall, bad conditioning,
the tiny models) is tested for both in tests/test_sd3_flux_adapters.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from diffusers import FluxPipeline
from sd3_flux_cases import FLUX, PROMPTS, SIZE, recompute, rollout

from rollout_consistency.adapters import flux
from rollout_consistency.adapters.tiny.sd3_flux import TINY_FLUX_CONFIG, load_flux

_rollout = partial(rollout, FLUX)
_recompute = partial(recompute, FLUX)


@pytest.fixture(scope="module")
def model():
    return load_flux()


@pytest.fixture(scope="module")
def cond():
    return FLUX.conditioning(PROMPTS, [""] * len(PROMPTS))


def test_packing_and_ids_are_the_pipelines():
    latents = torch.randn(2, 16, 8, 12, generator=torch.Generator().manual_seed(0))
    packed = flux.pack_latents(latents)
    assert torch.equal(packed, FluxPipeline._pack_latents(latents, 2, 16, 8, 12))
    assert torch.equal(flux.unpack_latents(packed, 8, 12), latents)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 64, 96, 8), latents)
    assert torch.equal(
        flux.latent_image_ids(8, 12), FluxPipeline._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32)
    )


def test_guidance_settings_reach_the_forward(model, cond):
    """The embedded guidance changes the prediction (and is stored, so the trainer uses the same value); a
    model without guidance_embeds ignores it, as FluxPipeline does; true CFG is neg + s·(cond − neg)."""
    latents = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(0))
    t = torch.full((4,), 750.0)
    positive = {k: v for k, v in cond.items() if not k.startswith("negative")}
    negative = {
        "prompt_embeds": cond["negative_prompt_embeds"],
        "pooled_prompt_embeds": cond["negative_pooled_prompt_embeds"],
    }
    with torch.no_grad():
        at_3_5 = flux.velocity(model, latents, t, positive, 3.5, options=SIZE)
        assert not torch.equal(at_3_5, flux.velocity(model, latents, t, positive, 5.0, options=SIZE))
        neg = flux.velocity(model, latents, t, negative, 3.5, options=SIZE)
        guided = flux.velocity(model, latents, t, cond, 3.5, options={**SIZE, "true_cfg_scale": 2.0})
        assert torch.equal(guided, neg + 2.0 * (at_3_5 - neg))
        schnell = load_flux(config={**TINY_FLUX_CONFIG, "guidance_embeds": False})
        assert torch.equal(
            flux.velocity(schnell, latents, t, positive, 3.5, options=SIZE),
            flux.velocity(schnell, latents, t, positive, 0.0, options=SIZE),
        )


# ---------------------------------------------------------------------------------------------- bad inputs
def test_wrong_latent_shape_is_refused(model, cond):
    trajectory = _rollout(model, cond)
    t = trajectory.timesteps[:, 0]
    unpacked = flux.unpack_latents(trajectory.latents[:, 0], 8, 8)
    with pytest.raises(ValueError, match=r"pack them with rollout_consistency.adapters.flux.pack_latents"):
        flux.velocity(model, unpacked, t, cond, 3.5, options=SIZE)
    with pytest.raises(ValueError, match="do not fit this FLUX transformer"):
        flux.velocity(model, trajectory.latents[:, 0], t, cond, 3.5, options={"height": 128, "width": 64})
    with pytest.raises(TypeError, match="float32"):
        flux.velocity(model, trajectory.latents[:, 0].bfloat16(), t, cond, 3.5, options=SIZE)
    other_size = load_flux(config={**TINY_FLUX_CONFIG, "in_channels": 32})
    with pytest.raises(ValueError, match="wrong latent shape for the model"):
        _recompute(other_size, trajectory)


def test_image_size_is_checked(model, cond):
    with pytest.raises(ValueError, match="multiples of 2\\*vae_scale_factor"):
        _rollout(model, cond, width=72)
