"""The edited copy of the SD trainer: it imports the `fastvideo` step and pipeline, not its own package's copies;
it samples with the pipeline, then re-scores each stored step
(`prev_sample=next_latents`) against the stored log-probs. Written for the lint's tests.

Lint fixture: parsed, never imported or run.
"""

import argparse

import torch
from accelerate import Accelerator

from fastvideo.models.stable_diffusion.ddim_with_logprob import ddim_step_with_logprob
from fastvideo.models.stable_diffusion.pipeline_with_logprob import pipeline_with_logprob
from fastvideo.utils.logging_ import main_print


def main(config, pipeline, prompt_embeds, optimizer):
    accelerator = Accelerator(mixed_precision=config.mixed_precision)
    with torch.no_grad():
        images, latents, log_probs = pipeline_with_logprob(pipeline, prompt_embeds, eta=config.sample.eta)
    latents = torch.stack(latents, dim=1)
    samples = {"latents": latents[:, :-1], "next_latents": latents[:, 1:], "log_probs": torch.stack(log_probs, 1)}
    for j, t in enumerate(pipeline.scheduler.timesteps):
        noise_pred = pipeline.unet(samples["latents"][:, j], t, prompt_embeds).sample
        _, log_prob = ddim_step_with_logprob(
            pipeline.scheduler,
            noise_pred,
            t,
            samples["latents"][:, j],
            eta=config.sample.eta,
            prev_sample=samples["next_latents"][:, j],
        )
        ratio = torch.exp(log_prob - samples["log_probs"][:, j])
        loss = -ratio.mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        main_print(f"step {j}: loss {loss.item():.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="fastvideo/config_sd/base.py")
    main(parser.parse_args(), None, None, None)
