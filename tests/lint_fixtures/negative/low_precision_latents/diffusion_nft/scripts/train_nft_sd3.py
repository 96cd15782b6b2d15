"""The DiffusionNFT-style trainer: keeps the images and latents, discards the log-probs.
Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

from nft.diffusers_patch.flux_pipeline_with_logprob import flux_pipeline_with_logprob
from nft.diffusers_patch.pipeline_with_logprob import pipeline_with_logprob


def sample_epoch(pipeline, prompt_embeds, pooled_prompt_embeds, sigmas, config):
    images, _, _ = pipeline_with_logprob(pipeline, prompt_embeds, pooled_prompt_embeds, sigmas, noise_level=0.0)
    images, latents, _ = pipeline_with_logprob(
        pipeline, prompt_embeds, pooled_prompt_embeds, sigmas, noise_level=config.sample.noise_level
    )
    return images, latents


def sample_flux_epoch(pipeline, prompt_embeds, sigmas):
    images, latents, _ = flux_pipeline_with_logprob(pipeline, prompt_embeds, sigmas)
    return images, latents
